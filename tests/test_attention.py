"""Prefill attention: whole prompts of one length share one batched attention call, with the same result as
attending to each segment alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.backends import attention
from engine.backends.attention import AttentionMetadata, PrefillSegment, paged_attention
from tests.test_engine import make_prompts, tiny_llm

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 4, 6, 2, 8


def segment(start: int, length: int, context_start: int = 0) -> PrefillSegment:
    return PrefillSegment(start, length, context_start, torch.zeros(1, dtype=torch.long))


def test_runs_group_consecutive_fresh_segments_of_one_length():
    segs = [segment(0, 5), segment(5, 5), segment(10, 5), segment(15, 3), segment(18, 3), segment(21, 3, 8),
            segment(24, 3), segment(27, 3)]
    runs = attention._prefill_runs(segs)
    assert [[s.start for s in run] for run in runs] == [[0, 5, 10], [15, 18], [21], [24, 27]]


def test_a_segment_with_cached_context_is_never_batched():
    runs = attention._prefill_runs([segment(0, 4, 4), segment(4, 4, 4)])
    assert [len(run) for run in runs] == [1, 1]


def batch_inputs(dtype: torch.dtype, rows: list[tuple[int, int]]):
    """rows: (context_start, length) per prefill segment, each sequence on its own blocks; one decode row first."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    next_block = iter(range(1, num_blocks))
    table = lambda tokens: [next(next_block) for _ in range(-(-tokens // BLOCK))]  # noqa: E731
    decode = [(table(9), 9)]
    prefills = [(table(start + length), start, length) for start, length in rows]
    meta = AttentionMetadata.build(BLOCK, decode, prefills)
    total = 1 + sum(length for _, length in rows)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, k_cache, v_cache, meta


def one_segment_at_a_time(q, k, v, k_cache, v_cache, meta, scale):
    """The reference: the per-segment path for every prefill segment (after the same page writes)."""
    out = torch.empty_like(q)
    out[: meta.num_decode] = attention._decode_attention(q[: meta.num_decode], k_cache, v_cache, meta, scale)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        if seg.context_start == 0:
            out[rows] = attention._fresh_attention(q[rows], k[rows], v[rows], 1, scale)
        else:
            out[rows] = attention._prefill_attention(q[rows], k_cache, v_cache, seg, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_prompts_match_one_segment_at_a_time_bit_for_bit(dtype, monkeypatch):
    q, k, v, k_cache, v_cache, meta = batch_inputs(dtype, [(0, 7), (0, 7), (0, 7), (5, 7), (0, 3), (0, 3)])
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw))
    batched = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3)
    # decode group, the run of three 7-token prompts, the prompt with cached context, the run of two
    assert [tuple(shape[:1]) for shape in calls] == [(1,), (3,), (1,), (2,)]
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    expected = one_segment_at_a_time(q, k, v, k_cache, v_cache, meta, 0.3)
    assert torch.equal(batched, expected)


def test_engine_with_equal_length_prompts_matches_one_at_a_time(tiny_model_dir, monkeypatch):
    """Whole prompts of one length in one step take the batched path; greedy output must not change."""
    prompts = [p[:12] for p in make_prompts(24, seed=3) if len(p) >= 12][:8]
    assert len(prompts) == 8
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = tiny_llm(tiny_model_dir, enable_prefix_caching=False)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    together = tiny_llm(tiny_model_dir, enable_prefix_caching=False, max_num_batched_tokens=256)
    batched = attention._fresh_attention
    sizes = []
    monkeypatch.setattr(attention, "_fresh_attention", lambda q, *a: sizes.append(a[2]) or batched(q, *a))
    assert [o.token_ids for o in together.generate(prompts, params)] == expected
    assert sizes and max(sizes) == len(prompts)  # all eight prompts in one call per layer
