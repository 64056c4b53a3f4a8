"""Paged attention as Triton kernels that read K and V pages in place through the block tables (no gather).

- `decode_attention`: one query row per sequence (or per verified token) against its context. A program takes
  one row and one KV head, with that head's whole query group as the rows of its products (GQA without repeating
  KV), and walks the context in tiles with an online softmax. With `splits` > 1 the context is cut into that many
  spans that run as programs of their own (flash-decoding: a batch of one still fills the GPU); a second kernel
  combines their partial sums. The grid depends only on the row count and `splits`, never on the context lengths,
  so a captured decode step (engine/core/cuda_graphs.py) replays for any lengths.
- `prefill_attention`: the query rows of several prefill segments in one launch, each attending causally to its
  cached prefix and to itself (chunked prefill with prefix hits), reading the keys from the pages (or, for a fresh
  chunk over a quantised cache, from its own unquantised keys: `dense_source`).
- `store_kv`: new tokens' keys or values into their slots; a slot of -1 (a padding row of a captured step) is
  skipped, where index_copy_ would need a real slot.

Both attention kernels take a sliding window (a query at p sees keys p - window < j <= p) and a logit soft-cap
(scores -> cap * tanh(score / cap) before the mask), as engine/backends/attention.py's reference does.

Pages: a plain [num_blocks, block_size, kv_heads, head_dim] tensor (fp32, fp16, bf16), or fp8 QuantizedPages
(engine/kv/formats.py: codes e4m3 [bs, H, D], then one fp32 scale per KV head), decoded here as dequantize_fp8
does: e4m3 -> fp32, times the head's scale in fp32, then to the query's dtype. Scores, softmax and sums are fp32.

The same code runs compiled on a GPU and, with TRITON_INTERPRET=1 set before this module is imported, on CPU
tensors (tests/test_triton_attention.py); the interpreter runs fp32 and fp16 exactly as written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kv.formats import QuantizedPages

DENSE_BLOCK = 1 << 30  # the "block size" of a dense source: every position of a segment lies in its block 0
MIN_DOT = 16  # the smallest extent of a tl.dot operand a GPU accepts


@triton.jit
def _e4m3_to_f32(codes):
    """uint8 E4M3 codes -> fp32 (engine/kernels/__init__.py: subnormals M * 2**-9, 0x7F / 0xFF NaN, -0 kept)."""
    c = codes.to(tl.int32)
    mag = c & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # exponent rebased from 7 to 127
    subnormal = (mag & 7).to(tl.float32) * 0.001953125
    value = tl.where(mag < 8, subnormal, normal)
    value = tl.where(mag == 0x7F, float("nan"), value)
    return tl.where((c & 0x80) != 0, -value, value)


@triton.jit
def _soft_cap(scores, cap):
    """cap * tanh(scores / cap), tanh written with exp (no tanh in every Triton backend) of a non-positive
    argument, which cannot overflow."""
    x = scores / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _kv_tile(pages, scales, table_row, pos, valid, head, dims, dim_ok, block_size, kv_start, s_block, s_slot,
             s_head, scale_block, scale_at, FP8: tl.constexpr):
    """[BLOCK_N, BLOCK_D] keys or values of one KV head at context positions `pos` (zeros where not `valid`)."""
    block = tl.load(table_row + pos // block_size, mask=valid, other=0).to(tl.int64)
    slot = (pos % block_size + kv_start).to(tl.int64)
    offsets = block[:, None] * s_block + slot[:, None] * s_slot + head * s_head + dims[None, :]
    x = tl.load(pages + offsets, mask=valid[:, None] & dim_ok[None, :], other=0)
    if FP8:
        scale = tl.load(scales + block * scale_block + scale_at + head, mask=valid, other=0.0)
        x = _e4m3_to_f32(x) * scale[:, None]
    return x


@triton.jit
def _decode_kernel(q, out, part_acc, part_ml, k_pages, v_pages, k_scales, v_scales, tables, lens,
                   sq_row, sq_head, so_row, so_head, s_table, block_size, s_block, s_slot, s_head, scale_block,
                   scale_at, sm_scale, softcap, window,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens + row).to(tl.int32)
    lo = ctx * 0
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    qt = tl.load(q + row * sq_row + heads[:, None] * sq_head + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                 other=0.0)
    table_row = tables + row * s_table
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _kv_tile(k_pages, k_scales, table_row, pos, valid, kv_head, d, d_ok, block_size, 0, s_block, s_slot,
                     s_head, scale_block, scale_at, FP8).to(qt.dtype)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * sm_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds a valid position
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = _kv_tile(v_pages, v_scales, table_row, pos, valid, kv_head, d, d_ok, block_size, 0, s_block, s_slot,
                     s_head, scale_block, scale_at, FP8).to(qt.dtype)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLITS == 1:
        o = acc / tl.where(l == 0, 1.0, l)[:, None]  # a padding row (ctx 0): zeros; a NaN key stays NaN
        tl.store(out + row * so_row + heads[:, None] * so_head + d[None, :], o.to(out.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        part = (row * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split  # [rows, Hq, SPLITS]
        tl.store(part_acc + part[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml + part * 2, m, mask=g_ok)
        tl.store(part_ml + part * 2 + 1, l, mask=g_ok)


@triton.jit
def _combine_kernel(out, part_acc, part_ml, so_row, so_head, num_heads,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """The splits of one row and query head into its output: their sums rescaled to the largest maximum."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    part = (row * num_heads + head) * SPLITS + tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_ml + part * 2)
    l = tl.load(part_ml + part * 2 + 1)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(m - top)  # an empty split (m = -inf) weighs 0
    total = tl.sum(w * l, 0)
    acc = tl.sum(w[:, None] * tl.load(part_acc + part[:, None] * BLOCK_D + d[None, :]), 0)
    o = acc / tl.where(total == 0, 1.0, total)
    tl.store(out + row * so_row + head * so_head + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(q, out, k_pages, v_pages, k_scales, v_scales, tables, q_starts, ctx_starts, lengths, kv_starts,
                    sq_row, sq_head, so_row, so_head, s_table, block_size, s_block, s_slot, s_head, scale_block,
                    scale_at, sm_scale, softcap, window,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                    PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.program_id(2)
    length = tl.load(lengths + seg).to(tl.int32)
    if tile * BLOCK_M >= length:
        return
    q_start = tl.load(q_starts + seg).to(tl.int64)
    ctx_start = tl.load(ctx_starts + seg).to(tl.int32)
    kv_start = tl.load(kv_starts + seg).to(tl.int32)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    q_pos = ctx_start + rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qt = tl.load(q + (q_start + rows)[:, None] * sq_row + head * sq_head + d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_head = head // GROUP
    table_row = tables + seg * s_table
    hi = ctx_start + tl.minimum((tile + 1) * BLOCK_M, length)  # past the tile's last query: causal
    lo = hi * 0
    if WINDOW:
        lo = tl.maximum(ctx_start + tile * BLOCK_M - window + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k = _kv_tile(k_pages, k_scales, table_row, pos, valid, kv_head, d, d_ok, block_size, kv_start, s_block,
                     s_slot, s_head, scale_block, scale_at, FP8).to(qt.dtype)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * sm_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing in this tile yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = _kv_tile(v_pages, v_scales, table_row, pos, valid, kv_head, d, d_ok, block_size, kv_start, s_block,
                     s_slot, s_head, scale_block, scale_at, FP8).to(qt.dtype)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(qt.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.where(l == 0, 1.0, l)[:, None]
    tl.store(out + (q_start + rows)[:, None] * so_row + head * so_head + d[None, :], o.to(out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _store_kernel(x, pages, slots, sx_row, sx_head, block_size, s_block, s_slot, s_head,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots + row)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    value = tl.load(x + row * sx_row + head * sx_head + d, mask=d_ok)
    at = (slot // block_size) * s_block + (slot % block_size) * s_slot + head * s_head
    tl.store(pages + at + d, value, mask=d_ok)


# ---------------------------------------------------------------- the torch-facing side


@dataclass(frozen=True)
class PageSource:
    """Where a kernel reads one layer's keys (or values): element strides of a block, a slot and a head (a dim's
    is 1), and for fp8 pages the fp32 view of the same bytes holding each page's per-head scales."""

    pages: torch.Tensor
    scales: torch.Tensor
    block_size: int
    kv_heads: int
    strides: tuple[int, int, int]
    scale_block: int = 0  # fp32 words per page
    scale_at: int = 0  # word of the first head's scale within a page
    fp8: bool = False

    def layout(self) -> tuple:
        """What the kernels take as the layout of both K and V (which must agree)."""
        return self.block_size, self.kv_heads, *self.strides, self.scale_block, self.scale_at, self.fp8


def page_source(cache: object) -> PageSource | None:
    """The kernels' view of a layer's pages: a plain 4-D tensor, or fp8 QuantizedPages (exact type: TieredPages
    mixing regions, and fp4 pages, are not read here); None for anything else."""
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 4 or cache.stride(3) != 1 or cache.dtype not in (torch.float32, torch.float16,
                                                                           torch.bfloat16):
            return None
        return PageSource(cache, cache, cache.shape[1], cache.shape[2], (cache.stride(0), cache.stride(1),
                                                                         cache.stride(2)))
    if type(cache) is not QuantizedPages or cache.format.name != "fp8" or not cache.raw.is_contiguous():
        return None
    block_size, kv_heads, head_dim = cache.format.page_shape
    page_bytes = cache.format.page_bytes
    return PageSource(cache.raw, cache.raw.view(torch.float32), block_size, kv_heads,
                      (page_bytes, kv_heads * head_dim, head_dim), page_bytes // 4, cache.format.fields[1].offset // 4,
                      fp8=True)


def dense_source(x: torch.Tensor) -> PageSource:
    """x [T, H, D] (rows may be strided, a dim's stride 1) read as one block per segment, from its kv_start."""
    return PageSource(x, x, DENSE_BLOCK, x.shape[1], (0, x.stride(0), x.stride(1)))


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 pages mean exactness; tf32 rounds the inputs


def decode_splits(rows: int, kv_heads: int, processors: int, most: int = 16) -> int:
    """Context splits of a decode launch: enough programs to give every processor about two, a power of two of
    at most `most`. A function of the row count only, so a captured step keeps its grid whatever the lengths."""
    want = -(-2 * processors // max(1, rows * kv_heads))
    return min(most, _pow2(want))


def decode_attention(q: torch.Tensor, k: PageSource, v: PageSource, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, splits: int = 1, block_n: int = 64) -> torch.Tensor:
    """q [R, Hq, D] (one query a row, the last of its context) -> [R, Hq, D] in q's dtype. block_tables [R, nb],
    context_lens [R]: a row of length 0 (padding) gives zeros."""
    rows, num_heads, head_dim = q.shape
    kv_heads = k.kv_heads
    if k.layout() != v.layout() or num_heads % kv_heads or splits & (splits - 1):
        raise ValueError(f"decode_attention: K and V layouts differ, {num_heads} heads over {kv_heads} KV heads, "
                         f"or {splits} splits (a power of two)")
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    block_d = _pow2(head_dim, MIN_DOT)
    part_acc = part_ml = out  # unused with one split
    if splits > 1:
        part_acc = torch.empty(rows, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(rows, kv_heads, splits)](
        q, out, part_acc, part_ml, k.pages, v.pages, k.scales, v.scales, block_tables, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k.block_size, *k.strides,
        k.scale_block, k.scale_at, scale, softcap or 1.0, window or 0,
        GROUP=group, BLOCK_G=_pow2(group, MIN_DOT), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLITS=splits, FP8=k.fp8, SOFTCAP=softcap is not None, WINDOW=window is not None,
        PRECISION=_precision(q.dtype))
    if splits > 1:
        _combine_kernel[(rows, num_heads)](out, part_acc, part_ml, out.stride(0), out.stride(1), num_heads,
                                           HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits)
    return out


@dataclass(frozen=True)
class Segments:
    """Prefill segments as the prefill kernel takes them, built once a step and shared by every layer: per
    segment its first row in q, tokens already cached, length, first key row of a dense source, and block table
    [S, nb] (padded with block 0)."""

    q_starts: torch.Tensor
    ctx_starts: torch.Tensor
    lengths: torch.Tensor
    kv_starts: torch.Tensor
    tables: torch.Tensor
    longest: int

    @staticmethod
    def build(rows: list[tuple[int, int, int, int]], tables: list[torch.Tensor],
              device: torch.device | str) -> "Segments":
        """rows: (q_start, context_start, length, kv_start) per segment; tables: each one's block table."""
        columns = torch.tensor(rows, dtype=torch.int32).t().contiguous().to(device)  # [4, S]
        padded = torch.nn.utils.rnn.pad_sequence([t.to(device) for t in tables], batch_first=True)
        return Segments(columns[0], columns[1], columns[2], columns[3], padded, max(r[2] for r in rows))


def prefill_attention(q: torch.Tensor, out: torch.Tensor, k: PageSource, v: PageSource, segments: Segments,
                      scale: float, window: int | None = None, softcap: float | None = None, block_m: int = 64,
                      block_n: int = 64) -> None:
    """Each segment's query rows of q [T, Hq, D] into the same rows of `out`, attending to its cached prefix and
    itself (causal; within `window`; soft-capped)."""
    num_heads, head_dim = q.shape[1:]
    if k.layout() != v.layout():
        raise ValueError("prefill_attention: K and V layouts differ")
    kv_heads = k.kv_heads
    if num_heads % kv_heads:
        raise ValueError(f"prefill_attention: {num_heads} heads over {kv_heads} KV heads")
    grid = (triton.cdiv(segments.longest, block_m), num_heads, len(segments.lengths))
    _prefill_kernel[grid](
        q, out, k.pages, v.pages, k.scales, v.scales, segments.tables, segments.q_starts, segments.ctx_starts,
        segments.lengths, segments.kv_starts, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        segments.tables.stride(0), k.block_size, *k.strides, k.scale_block, k.scale_at, scale, softcap or 1.0,
        window or 0, GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim, MIN_DOT),
        BLOCK_M=block_m, BLOCK_N=block_n, FP8=k.fp8, SOFTCAP=softcap is not None, WINDOW=window is not None,
        PRECISION=_precision(q.dtype))


def store_kv(x: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
    """x [T, H, D] into pages [N, bs, H, D] at slots [T] (block * bs + offset); rows whose slot is -1 are skipped."""
    rows, heads, head_dim = x.shape
    if rows:
        _store_kernel[(rows, heads)](x, pages, slots, x.stride(0), x.stride(1), pages.shape[1], pages.stride(0),
                                     pages.stride(1), pages.stride(2), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim))
