"""The default SmolLM2-135M-Instruct GGUF against transformers' own GGUF loading of the same file."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.test_model_parity import assert_close_relative, paged_logits

pytestmark = pytest.mark.slow
PROMPT = "The history of the Roman Empire begins with"


@pytest.fixture(scope="module")
def hf_model(hf_gguf_model):
    return hf_gguf_model


@pytest.fixture(scope="module")
def llm_fp32():
    return LLM(dtype="float32", num_kv_blocks=64)


def test_fp32_logits_match_transformers_gguf(hf_model, llm_fp32):
    ids = llm_fp32.tokenizer.encode(PROMPT)
    model = llm_fp32.engine.runner.model
    with torch.inference_mode():
        ours = paged_logits(model, model.cfg, ids, chunk=1000)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert_close_relative(ours, ref, 1e-3)


def test_32_greedy_tokens_identical(hf_model, llm_fp32):
    ids = llm_fp32.tokenizer.encode(PROMPT)
    ours = llm_fp32.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, len(ids):].tolist()


def test_chat_reply_is_coherent_english():
    llm = LLM(num_kv_blocks=64)  # bf16, the serving dtype
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0))[0]
    print(f"\nSmolLM2 bf16 chat reply: {out.text!r}")
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
