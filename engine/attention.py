"""Paged attention: one batched gather of the needed KV blocks, then scaled-dot-product attention; where the
backend has an in-place kernel for the decode group (engine/backends/, no gather) or for whole fresh prompts, that
kernel instead.

The flat batch holds decode rows first (one new token per sequence, attended as one group), then each
prefill chunk as a contiguous segment. New keys/values are written into their cache slots before
attention, so a chunk sees every earlier token of its sequence, cached or computed in this step.
Consecutive whole prompts of one length (no cached context) attend in one batched call: bit-identical to
one call each, and one call per layer instead of one per prompt when a step prefills many short prompts.

A layer's cache is either a tensor [num_blocks, block_size, kv_heads, head_dim] in the serving dtype or
QuantizedPages (fp8 / fp4, engine/kv/formats.py): those quantise new tokens as they are written and
dequantise gathered pages to the serving dtype; everything after the gather is the same. A prefill chunk
without cached context attends to its fresh keys/values directly, so with a quantised cache the first
chunk of a prompt sees unquantised keys and every later chunk or decode step sees quantised ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kv.compress import TieredPages
from engine.kv.formats import PageWrites, QuantizedPages

if TYPE_CHECKING:
    from engine.backends.base import Backend

KVPages = torch.Tensor | QuantizedPages  # one layer's keys or values


@dataclass
class PrefillSegment:
    """One sequence's prefill chunk: rows [start, start + length) of the flat batch."""

    start: int
    length: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] int64, covering context_start + length tokens
    causal_mask: torch.Tensor | None = None  # [length, context_start + length] bool; None when context_start == 0


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and which cached blocks each query row attends to."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    num_decode: int = 0  # rows of the decode group
    num_decode_seqs: int = 0  # sequences they belong to (a verified sequence brings several rows)
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool: key is in the context
    decode_context_lens: torch.Tensor | None = None  # [D] int64
    # the backend's in-place decode attention may serve this step (the runner's steps; a draft proposer's gather)
    use_kernels: bool = False
    prefills: list[PrefillSegment] = field(default_factory=list)
    page_writes: PageWrites | None = None  # built on first use by a quantised cache, shared by its layers

    @staticmethod
    def build(block_size: int, decode_rows: list[tuple[list[int], int]],
              prefill_rows: list[tuple[list[int], int, int]], use_kernels: bool = False,
              num_decode_seqs: int | None = None, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """decode_rows: (block_table, context_len); prefill_rows: (block_table, context_start, length).
        num_decode_seqs: how many sequences the decode rows belong to (default: one row each). The tensors
        are made on `device`, the KV pages' device."""
        slots: list[int] = []
        for table, context_len in decode_rows:
            slots.append(_slot(table, context_len - 1, block_size))
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode_rows),
                                 num_decode_seqs=len(decode_rows) if num_decode_seqs is None else num_decode_seqs,
                                 use_kernels=use_kernels)
        if decode_rows:
            meta.decode_block_tables, meta.decode_context_lens = _decode_tables(decode_rows, block_size, device)
        start = len(decode_rows)
        for table, context_start, length in prefill_rows:
            slots.extend(_slot(table, pos, block_size) for pos in range(context_start, context_start + length))
            meta.prefills.append(_prefill_segment(table, start, context_start, length, block_size, device))
            start += length
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        return meta


def _slot(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def _decode_tables(rows: list[tuple[list[int], int]], block_size: int,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [D, max_blocks] padded with block 0, and context lengths [D]."""
    max_blocks = max((context_len + block_size - 1) // block_size for _, context_len in rows)
    padded = [table[:max_blocks] + [0] * (max_blocks - min(len(table), max_blocks)) for table, _ in rows]
    return (torch.tensor(padded, dtype=torch.long, device=device),
            torch.tensor([n for _, n in rows], dtype=torch.long, device=device))


def _decode_mask(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """[D, 1, 1, max_blocks * block_size] bool: the key is inside the sequence's context (built lazily: the
    in-place kernel does not need it)."""
    if meta.decode_mask is None:
        width = meta.decode_block_tables.shape[1] * block_size
        lens = meta.decode_context_lens
        meta.decode_mask = (torch.arange(width, device=lens.device) < lens[:, None])[:, None, None, :]
    return meta.decode_mask


def _prefill_segment(table: list[int], start: int, context_start: int, length: int, block_size: int,
                     device: torch.device | str) -> PrefillSegment:
    total = context_start + length
    used = table[: (total + block_size - 1) // block_size]
    mask = None
    if context_start:
        query_pos = torch.arange(context_start, total, device=device)[:, None]
        mask = torch.arange(total, device=device)[None, :] <= query_pos  # [length, total]
    return PrefillSegment(start, length, context_start, torch.tensor(used, dtype=torch.long, device=device), mask)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVPages,
                    v_cache: KVPages, meta: AttentionMetadata, scale: float,
                    backend: Backend | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; caches [num_blocks, block_size, Hkv, D] (or
    quantised pages). Returns [T, Hq, D]. `backend`: whose kernels may take the decode group and fresh prompts
    (None, or a step without meta.use_kernels: SDPA throughout)."""
    backend = backend if meta.use_kernels else None
    _write(k_cache, k, meta)
    _write(v_cache, v, meta)
    if meta.num_decode and not meta.prefills:  # decode only: no copy into a shared output
        return _decode(q, k_cache, v_cache, meta, scale, backend)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = _decode(q[: meta.num_decode], k_cache, v_cache, meta, scale, backend)
    for run in _prefill_runs(meta.prefills):
        rows = slice(run[0].start, run[-1].start + run[-1].length)
        if run[0].context_start == 0:
            out[rows] = _fresh(q[rows], k[rows], v[rows], len(run), scale, backend)
        else:
            out[rows] = _prefill_attention(q[rows], k_cache, v_cache, run[0], scale)
    return out


def _decode(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages, meta: AttentionMetadata, scale: float,
            backend: Backend | None) -> torch.Tensor:
    out = backend.decode_attention(q, k_cache, v_cache, meta, scale) if backend is not None else None
    return _decode_attention(q, k_cache, v_cache, meta, scale) if out is None else out


def _fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
           backend: Backend | None) -> torch.Tensor:
    out = backend.fresh_attention(q, k, v, count, scale) if backend is not None else None
    return _fresh_attention(q, k, v, count, scale) if out is None else out


def _prefill_runs(segments: list[PrefillSegment]) -> list[list[PrefillSegment]]:
    """Consecutive segments without cached context and of one length form a run (one batched attention);
    any other segment is a run of its own."""
    runs: list[list[PrefillSegment]] = []
    for seg in segments:
        last = runs[-1][-1] if runs else None
        if (last is not None and seg.context_start == 0 and last.context_start == 0
                and seg.length == last.length and seg.start == last.start + last.length):
            runs[-1].append(seg)
        else:
            runs.append([seg])
    return runs


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float) -> torch.Tensor:
    # q [count * S, Hq, hd]: `count` whole prompts of S tokens each, attending only to themselves
    rows, num_heads, head_dim = q.shape
    qh = q.view(count, rows // count, num_heads, head_dim).transpose(1, 2)  # [count, Hq, S, hd]
    kh = k.view(count, rows // count, *k.shape[1:]).transpose(1, 2)  # [count, Hkv, S, hd]
    vh = v.view(count, rows // count, *v.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows, num_heads, head_dim)


def _write(cache: KVPages, x: torch.Tensor, meta: AttentionMetadata) -> None:
    if isinstance(cache, TieredPages):
        cache = cache.hot  # new tokens always land in hot blocks; TieredPages.gather reads both regions
    if isinstance(cache, torch.Tensor):
        cache.view(-1, *x.shape[1:]).index_copy_(0, meta.slot_mapping, x)
        return
    if meta.page_writes is None:
        meta.page_writes = PageWrites.build(meta.slot_mapping, cache.block_size)
    cache.write(meta.page_writes, x)


def _gather(cache: KVPages, block_tables: torch.Tensor) -> torch.Tensor:
    # cache [N, bs, Hkv, D], block_tables [B, nb] -> [B, Hkv, nb * bs, D]
    if isinstance(cache, torch.Tensor):  # index_select on whole flat pages: ~4x faster than 4-D indexing
        b, nb = block_tables.shape
        bs, h, d = cache.shape[1:]
        blocks = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    else:
        blocks = cache.gather(block_tables)
        b, nb, bs, h, d = blocks.shape  # [B, nb, bs, Hkv, D]
    return blocks.view(b, nb * bs, h, d).transpose(1, 2)


def _decode_attention(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # One query per sequence: fold each KV head's query group into the query-length axis, so no KV repeat.
    num_rows, num_heads, head_dim = q.shape
    keys = _gather(k_cache, meta.decode_block_tables)  # [D, Hkv, L, hd]
    num_kv_heads = keys.shape[1]
    values = _gather(v_cache, meta.decode_block_tables)
    grouped_q = q.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [D, Hkv, G, hd]
    mask = _decode_mask(meta, keys.shape[2] // meta.decode_block_tables.shape[1])
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_rows, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages, seg: PrefillSegment,
                       scale: float) -> torch.Tensor:
    # q [S, Hq, hd], a chunk after `seg.context_start` cached tokens: it attends to them and to itself, all
    # gathered from the pages (its own keys/values were written there first).
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, S, hd]
    total = seg.context_start + seg.length
    keys = _gather(k_cache, seg.block_table[None])[:, :, :total]
    values = _gather(v_cache, seg.block_table[None])[:, :, :total]
    out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=seg.causal_mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
