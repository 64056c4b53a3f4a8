"""Paged attention: one batched gather of the needed KV blocks, then scaled-dot-product attention; where the
backend has an in-place kernel for the decode group (engine/backends/, no gather), for whole fresh prompts or for
every prefill segment of the step, that kernel instead.

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

A windowed layer (sliding_window W) lets the query at position p see keys p - W < j <= p only, through the
same gathers with a narrower mask; a soft-capped layer (Gemma 2) caps the scores as cap * tanh(s / cap) before
the mask. Each backend hook is given both and declines what its kernel does not compute: the CPU kernels serve
a windowed layer only where the window cuts no row's context (every context within W tokens: the same result),
and never a soft-capped one; the Triton kernels (engine/backends/triton_attention.py) mask both themselves.

A windowed layer's table may name NULL_BLOCK (engine/kv/groups.py: a block given back, wholly before the
window of every query of the step): it is gathered as block 0 and masked out like everything else before the
window, and never written. A context that long is cut by the window, so no kernel sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kv.compress import TieredPages
from engine.kv.formats import PageWrites, QuantizedPages

KVPages = torch.Tensor | QuantizedPages  # one layer's keys or values


@dataclass
class PrefillSegment:
    """One sequence's prefill chunk: rows [start, start + length) of the flat batch."""

    start: int
    length: int
    context_start: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # [num_blocks] int64, covering context_start + length tokens
    causal_mask: torch.Tensor | None = None  # [length, context_start + length] bool; None when context_start == 0
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> causal_mask within it

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[length, context_start + length] bool: key j is visible to the row's query (causal, and within
        `window` where one is given); None where plain causal attention over a fresh chunk is meant."""
        if window is None or self.context_start + self.length <= window:
            return self.causal_mask
        if window not in self.window_masks:
            device = self.block_table.device
            self.window_masks[window] = _window_mask(torch.arange(self.context_start, self.context_start + self.length,
                                                                  device=device),
                                                     self.context_start + self.length, window)
        return self.window_masks[window]


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and which cached blocks each query row attends to."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    num_decode: int = 0  # rows of the decode group
    num_decode_seqs: int = 0  # sequences they belong to (a verified sequence brings several rows)
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool: key is in the context
    decode_context_lens: torch.Tensor | None = None  # [D] int64
    max_decode_context: int = 0  # the longest of decode_context_lens
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> decode mask within it
    # the backend's in-place decode attention may serve this step (the runner's steps; a draft proposer's gather)
    use_kernels: bool = False
    prefills: list[PrefillSegment] = field(default_factory=list)
    page_writes: PageWrites | None = None  # built on first use by a quantised cache, shared by its layers
    # what a backend's kernels derive from this metadata (their segment tables, a planned launch), built by the
    # first layer that needs it and shared by the others: keyed by the backend
    kernel_inputs: dict = field(default_factory=dict)

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
            meta.max_decode_context = max(n for _, n in decode_rows)
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
    return (torch.tensor(padded, dtype=torch.long, device=device).clamp_(min=0),  # NULL_BLOCK -> block 0
            torch.tensor([n for _, n in rows], dtype=torch.long, device=device))


def _decode_mask(meta: AttentionMetadata, block_size: int, window: int | None = None) -> torch.Tensor:
    """[D, 1, 1, max_blocks * block_size] bool: the key is inside the sequence's context, and within the last
    `window` positions of it where a window is given (built lazily: the in-place kernel does not need it)."""
    if window is not None and meta.max_decode_context > window:
        if window not in meta.decode_window_masks:
            lens = meta.decode_context_lens
            keys = torch.arange(meta.decode_block_tables.shape[1] * block_size, device=lens.device)
            meta.decode_window_masks[window] = ((keys < lens[:, None])
                                                & (keys >= lens[:, None] - window))[:, None, None, :]
        return meta.decode_window_masks[window]
    if meta.decode_mask is None:
        width = meta.decode_block_tables.shape[1] * block_size
        lens = meta.decode_context_lens
        meta.decode_mask = (torch.arange(width, device=lens.device) < lens[:, None])[:, None, None, :]
    return meta.decode_mask


def _window_mask(query_pos: torch.Tensor, total: int, window: int) -> torch.Tensor:
    """[len(query_pos), total] bool: key j is visible from query position p iff p - window < j <= p."""
    keys = torch.arange(total, device=query_pos.device)[None, :]
    return (keys <= query_pos[:, None]) & (keys > query_pos[:, None] - window)


def _prefill_segment(table: list[int], start: int, context_start: int, length: int, block_size: int,
                     device: torch.device | str) -> PrefillSegment:
    total = context_start + length
    used = table[: (total + block_size - 1) // block_size]
    mask = None
    if context_start:
        query_pos = torch.arange(context_start, total, device=device)[:, None]
        mask = torch.arange(total, device=device)[None, :] <= query_pos  # [length, total]
    table_tensor = torch.tensor(used, dtype=torch.long, device=device).clamp_(min=0)  # NULL_BLOCK -> block 0
    return PrefillSegment(start, length, context_start, table_tensor, mask)


class AttentionKernels(Protocol):
    """The backend's in-place attention kernels (engine/backends/base.py Backend): each returns None (or False)
    where it declines, and the gather path below serves."""

    def write_kv(self, cache: object, x: torch.Tensor, slot_mapping: torch.Tensor) -> bool: ...

    def decode_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, meta: AttentionMetadata,
                         scale: float, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor | None: ...

    def fresh_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor | None: ...

    def extend_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int,
                         scale: float, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor | None: ...

    def paged_extend_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, block_table: torch.Tensor,
                               context: int, scale: float, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor | None: ...

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: object,
                          v_cache: object, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                          window: int | None = None, softcap: float | None = None) -> bool: ...


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVPages,
                    v_cache: KVPages, meta: AttentionMetadata, scale: float,
                    backend: AttentionKernels | None = None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; caches [num_blocks, block_size, Hkv, D] (or
    quantised pages). Returns [T, Hq, D]. `backend`: whose kernels may take the decode group and fresh prompts
    (None, or a step without meta.use_kernels: SDPA throughout). `window`: the layer's sliding window (None:
    whole contexts); `softcap`: the layer's attention-score cap (None: uncapped)."""
    backend = backend if meta.use_kernels else None
    _write(k_cache, k, meta, backend)
    _write(v_cache, v, meta, backend)
    if meta.num_decode and not meta.prefills:  # decode only: no copy into a shared output
        return _decode(q, k_cache, v_cache, meta, scale, backend, window, softcap)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[: meta.num_decode] = _decode(q[: meta.num_decode], k_cache, v_cache, meta, scale, backend, window,
                                         softcap)
    if backend is not None and backend.prefill_attention(q, k, v, k_cache, v_cache, meta, scale, out, window,
                                                         softcap):
        return out
    for run in _prefill_runs(meta.prefills):
        rows = slice(run[0].start, run[-1].start + run[-1].length)
        if run[0].context_start == 0:
            out[rows] = _fresh(q[rows], k[rows], v[rows], len(run), scale, backend, window, softcap)
        else:
            out[rows] = _prefill_attention(q[rows], k_cache, v_cache, run[0], scale, backend, window, softcap)
    return out


def _decode(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages, meta: AttentionMetadata, scale: float,
            backend: AttentionKernels | None, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    out = None if backend is None else backend.decode_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    return _decode_attention(q, k_cache, v_cache, meta, scale, window, softcap) if out is None else out


def _fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
           backend: AttentionKernels | None, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    length = len(q) // count
    window = window if window is not None and window < length else None  # a window wider than the prompt
    out = None if backend is None else backend.fresh_attention(q, k, v, count, scale, window, softcap)
    return _fresh_attention(q, k, v, count, scale, window, softcap) if out is None else out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, causal: bool = False) -> torch.Tensor:
    """SDPA with grouped KV heads: q [B, Hq, S, D], k/v [B, Hkv, L, D], mask bool broadcastable to [B, Hq, S, L]
    with a head axis of 1 (or None; `causal`: a causal mask over S == L) -> [B, Hq, S, D]. With `softcap` the
    scores are capped before the mask, as transformers' eager attention does (SDPA has no such hook)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    b, num_heads, s, d = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, s, d)  # [B, Hkv, G, S, D]
    scores = torch.matmul(grouped, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, S, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        mask = torch.ones(s, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~(mask.unsqueeze(1) if mask.dim() == 4 else mask), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).reshape(b, num_heads, s, d)


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


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                     window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    # q [count * S, Hq, hd]: `count` whole prompts of S tokens each, attending only to themselves (within the
    # last `window` positions, where one is given: it is narrower than S then)
    rows, num_heads, head_dim = q.shape
    length = rows // count
    qh = q.view(count, length, num_heads, head_dim).transpose(1, 2)  # [count, Hq, S, hd]
    kh = k.view(count, length, *k.shape[1:]).transpose(1, 2)  # [count, Hkv, S, hd]
    vh = v.view(count, length, *v.shape[1:]).transpose(1, 2)
    mask = None if window is None else _window_mask(torch.arange(length, device=q.device), length, window)
    out = attend(qh, kh, vh, mask, scale, softcap, causal=True)
    return out.transpose(1, 2).reshape(rows, num_heads, head_dim)


def _write(cache: KVPages, x: torch.Tensor, meta: AttentionMetadata, backend: AttentionKernels | None) -> None:
    if isinstance(cache, TieredPages):
        cache = cache.hot  # new tokens always land in hot blocks; TieredPages.gather reads both regions
    if backend is not None and backend.write_kv(cache, x, meta.slot_mapping):
        return
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


def _decode_attention(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages, meta: AttentionMetadata, scale: float,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    # One query per sequence: fold each KV head's query group into the query-length axis, so no KV repeat.
    num_rows, num_heads, head_dim = q.shape
    keys = _gather(k_cache, meta.decode_block_tables)  # [D, Hkv, L, hd]
    num_kv_heads = keys.shape[1]
    values = _gather(v_cache, meta.decode_block_tables)
    grouped_q = q.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [D, Hkv, G, hd]
    mask = _decode_mask(meta, keys.shape[2] // meta.decode_block_tables.shape[1], window)
    out = attend(grouped_q, keys, values, mask, scale, softcap)
    return out.reshape(num_rows, num_heads, head_dim)


def _prefill_attention(q: torch.Tensor, k_cache: KVPages, v_cache: KVPages, seg: PrefillSegment, scale: float,
                       backend: AttentionKernels | None = None, window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    # q [S, Hq, hd], a chunk after `seg.context_start` cached tokens: it attends to them and to itself, all
    # gathered from the pages (its own keys/values were written there first), or read in place by the backend.
    total = seg.context_start + seg.length
    if backend is not None:
        wide = window is not None and window >= total  # a window that cuts nothing
        out = backend.paged_extend_attention(q, k_cache, v_cache, seg.block_table, seg.context_start, scale,
                                             None if wide else window, softcap)
        if out is not None:
            return out
    keys = _gather(k_cache, seg.block_table[None])[:, :, :total]  # [1, Hkv, total, hd], a view of token rows
    values = _gather(v_cache, seg.block_table[None])[:, :, :total]
    if backend is not None:
        wide = window is not None and window >= total  # a window that cuts nothing
        out = backend.extend_attention(q, keys[0].transpose(0, 1), values[0].transpose(0, 1), seg.context_start,
                                       scale, None if wide else window, softcap)
        if out is not None:
            return out
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, S, hd]
    out = attend(qh, keys, values, seg.mask(window), scale, softcap)
    return out[0].transpose(0, 1)
