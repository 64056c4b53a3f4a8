"""Measured logits parity against Hugging Face transformers (the tests assert bounds; this prints values).

    python -m bench.parity
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.model.gguf_loader import default_model_path
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.test_model_parity import VARIANTS, _qwen2_config, paged_logits, reference_logits
from tests.tiny_models import tiny_llama_config, write_tiny_model

PROMPT = "The history of the Roman Empire begins with"


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def tiny_variants() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in [*VARIANTS, "qwen2"]:
            config = _qwen2_config() if name == "qwen2" else tiny_llama_config(**VARIANTS[name])
            folder = write_tiny_model(Path(tmp) / name, config, seed=1)
            cfg = read_hf_config(folder)
            model = build_model(cfg, iter_hf_weights(folder), torch.float32)
            ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
            with torch.inference_mode():
                err = relative_error(paged_logits(model, cfg, ids, 7), reference_logits(folder, ids))
            print(f"tiny {name:<24} fp32 max relative logit error {err:.2e} (chunked prefill, 37 tokens)")


def default_model() -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", num_kv_blocks=64)
    ids = llm.tokenizer.encode(PROMPT)
    model = llm.engine.runner.model
    with torch.inference_mode():
        err = relative_error(paged_logits(model, model.cfg, ids, 1000), ref(torch.tensor([ids])).logits[0].float())
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(ids):]
    ours = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    same = sum(1 for a, b in zip(ours, hf.tolist()) if a == b)
    print(f"SmolLM2 GGUF fp32 max relative logit error vs transformers' GGUF load: {err:.2e}; "
          f"greedy tokens identical {same}/32")


if __name__ == "__main__":
    tiny_variants()
    default_model()
