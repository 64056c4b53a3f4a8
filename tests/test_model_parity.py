"""Logits of our paged-attention model against Hugging Face transformers on the same safetensors folder."""
from __future__ import annotations

import pytest
import torch

from engine.backends.attention import AttentionMetadata
from engine.kv.cache import KVCache
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.tiny_models import tiny_llama_config, tiny_qwen3_config, write_tiny_model

BLOCK = 4


def paged_logits(model, cfg, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Run the prompt through the paged path in chunks of `chunk` tokens; logits for every position."""
    num_blocks = (len(token_ids) + BLOCK - 1) // BLOCK
    kv = KVCache(cfg, num_blocks + 2, BLOCK, next(model.parameters()).dtype)
    table = list(range(2, num_blocks + 2))[::-1]  # non-trivial block order
    rows = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start:start + chunk]
        meta = AttentionMetadata.build(BLOCK, [], [(table, start, len(ids))])
        hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, kv.layers)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


def decode_logits(model, cfg, token_ids: list[int]) -> torch.Tensor:
    """Prefill the first token, then feed the rest one token at a time through the decode group."""
    kv = KVCache(cfg, len(token_ids) // BLOCK + 2, BLOCK, next(model.parameters()).dtype)
    table = list(range(len(token_ids) // BLOCK + 2))
    rows = []
    for pos, tok in enumerate(token_ids):
        meta = AttentionMetadata.build(BLOCK, [(table, pos + 1)], [])
        hidden = model(torch.tensor([tok]), torch.tensor([pos]), meta, kv.layers)
        rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


VARIANTS = {
    "llama-tied": dict(),
    "llama-gqa-untied-bias": dict(num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True),
    "llama3-rope": dict(num_key_value_heads=1, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                   high_freq_factor=4.0,
                                                                   original_max_position_embeddings=64)),
    "linear-rope": dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
}


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False, rms_norm_eps=1e-6)


QWEN3_VARIANTS = {
    "qwen3-tied": dict(),
    "qwen3-untied-bias": dict(tie_word_embeddings=False, attention_bias=True, num_key_value_heads=1),
}


def _config(name: str):
    if name == "qwen2":
        return _qwen2_config()
    if name in QWEN3_VARIANTS:
        return tiny_qwen3_config(**QWEN3_VARIANTS[name])
    return tiny_llama_config(**VARIANTS[name])


@pytest.fixture(scope="module", params=[*VARIANTS, "qwen2", *QWEN3_VARIANTS])
def checkpoint(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), _config(request.param), seed=1,
                            random_norms=request.param in QWEN3_VARIANTS)


def reference_logits(folder, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def assert_close_relative(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < tol, f"max relative logit error {rel:.2e} >= {tol}"


@pytest.mark.parametrize("chunk", [1000, 7])
def test_prefill_logits_match_transformers(checkpoint, chunk):
    cfg = read_hf_config(checkpoint)
    model = build_model(cfg, iter_hf_weights(checkpoint), torch.float32)
    token_ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_close_relative(paged_logits(model, cfg, token_ids, chunk), reference_logits(checkpoint, token_ids), 1e-4)


def test_decode_logits_match_transformers(checkpoint):
    cfg = read_hf_config(checkpoint)
    model = build_model(cfg, iter_hf_weights(checkpoint), torch.float32)
    token_ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_close_relative(decode_logits(model, cfg, token_ids), reference_logits(checkpoint, token_ids), 1e-4)


@pytest.mark.parametrize("keep", [[36, 5, 0], []], ids=["three-rows", "none"])
def test_kept_rows_match_transformers_and_every_row_reaches_the_pages(checkpoint, keep):
    """keep_rows: the last layer's products after attention run on those rows only (a prefill step reads only
    the sampled rows). Their logits still match transformers, in the order asked, and the pages hold every
    row's keys and values, bit for bit as a forward without keep_rows writes them."""
    cfg = read_hf_config(checkpoint)
    model = build_model(cfg, iter_hf_weights(checkpoint), torch.float32)
    token_ids = torch.randint(0, cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    table = list(range(10))
    pages = []
    for keep_rows in (None, torch.tensor(keep, dtype=torch.long)):
        kv = KVCache(cfg, 10, BLOCK, torch.float32)
        meta = AttentionMetadata.build(BLOCK, [], [(table, 0, len(token_ids))])
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), meta, kv.layers, keep_rows=keep_rows)
        pages.append(kv.layers)
    assert hidden.shape == (len(keep), cfg.hidden_size)
    if keep:
        assert_close_relative(model.compute_logits(hidden), reference_logits(checkpoint, token_ids)[keep], 1e-4)
    for full, kept in zip(*pages):
        assert torch.equal(full[0], kept[0]) and torch.equal(full[1], kept[1])
