"""Quantised KV pages: their byte layout and the per-layer store that paged attention writes and gathers.

A quantised pool is one uint8 tensor [num_layers, 2, num_blocks, page_bytes]. Each page (one block of one
layer's keys or values) holds its codes followed by their scales, so a page is a self-contained unit that
moves between actors as bytes and the pool exports exactly as an unquantised one does:

    fp8  codes [bs, H, D] e4m3 | scales [H] fp32 (one per kv-head)
    fp4  packed [bs, H, D/2] e2m1 | block scales [bs, H, D/16] e4m3 | page scale fp32
         (each field starts at a multiple of 4 bytes; pages are padded to a multiple of 4)

The encodings themselves (rounding, saturation, NaN) are engine/kernels' (see engine/kernels/__init__.py).

Writing: scales are per page, so a page is re-quantised as it fills. The touched pages are dequantised
(to fp32), the new tokens inserted, and the pages quantised again in one batched kernel call. Scales are
powers of two (engine/kernels/__init__.py), so when a later token raises a page's (or a kv-head's) maximum,
the codes already there move by an exact power of two rather than being rounded onto a coarser grid: a page
written token by token holds the same bytes as one written whole (tests/test_kv_cache_quant.py), except
where a value drops into E4M3's subnormal range, 2**-15 below its head's maximum. (Scales of exactly
amax / 448 would round the page's earlier tokens again at every growth: docs/performance.md, "KV page
scales", for what that cost.)

Slots past the last one written in a step are zeroed before quantising: they hold a previous owner's
stale tokens (or rejected speculative drafts), which must not widen the scales. This relies on each
sequence filling its pages in position order, which the scheduler guarantees (prefix-cache hits share
only full pages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from engine.kernels.kv_quant_src import FP4_GROUP

KV_FORMATS = ("fp8", "fp4")  # quantised formats; "auto" (the serving dtype) is the unquantised pool
PAGE_ALIGN = 4  # bytes: every field (and so every page) starts at a multiple of the widest scale's size
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # what the kernels read and write


@dataclass(frozen=True)
class PageField:
    """One array inside a page: `shape` per page, stored from byte `offset`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    per_slot: bool  # the first dimension is the block's token slot

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class PageFormat:
    name: str
    page_shape: tuple[int, int, int]  # (block_size, kv_heads, head_dim) of the values a page holds
    fields: tuple[PageField, ...]
    page_bytes: int
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # [P, bs, H, D] -> one tensor per field
    dequantize: Callable[..., torch.Tensor]  # (*fields, dtype=) -> [P, bs, H, D]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype, bool]]) -> tuple[tuple[PageField, ...], int]:
    fields, offset = [], 0
    for shape, dtype, per_slot in specs:
        fields.append(PageField(shape, dtype, offset, per_slot))
        offset = _round_up(offset + fields[-1].nbytes, PAGE_ALIGN)
    return tuple(fields), offset


def page_format(name: str, block_size: int, kv_heads: int, head_dim: int) -> PageFormat:
    bs, h, d = block_size, kv_heads, head_dim
    if name == "fp8":
        fields, page_bytes = _layout([((bs, h, d), torch.uint8, True), ((h,), torch.float32, False)])
        return PageFormat(name, (bs, h, d), fields, page_bytes, quantize_fp8, dequantize_fp8)
    if name == "fp4":
        if d % FP4_GROUP:
            raise ValueError(f"kv_cache_dtype fp4 needs head_dim to be a multiple of {FP4_GROUP}, got {d}")
        fields, page_bytes = _layout([((bs, h, d // 2), torch.uint8, True),
                                      ((bs, h, d // FP4_GROUP), torch.uint8, True),
                                      ((), torch.float32, False)])
        return PageFormat(name, (bs, h, d), fields, page_bytes, quantize_fp4, dequantize_fp4)
    raise ValueError(f"unknown KV page format {name!r}; expected one of {', '.join(KV_FORMATS)}")


def fingerprint_offsets(fmt: PageFormat) -> torch.Tensor:
    """Byte offsets within a page that the hand-off checksum samples: the first and last slot of each
    per-slot field and the whole of each scale field. [S] int64."""
    block_size = fmt.page_shape[0]
    ranges = []
    for f in fmt.fields:
        if f.per_slot:
            slot_bytes = f.nbytes // block_size
            ranges += [torch.arange(f.offset, f.offset + slot_bytes),
                       torch.arange(f.offset + f.nbytes - slot_bytes, f.offset + f.nbytes)]
        else:
            ranges.append(torch.arange(f.offset, f.offset + f.nbytes))
    return torch.cat(ranges)


@dataclass(frozen=True)
class PageWrites:
    """Where one step's new tokens land, page by page; the same for every layer, so built once a step."""

    pages: torch.Tensor  # [P] int64 block ids touched, ascending
    page_index: torch.Tensor  # [T] int64 row of each new token's page in `pages`
    offsets: torch.Tensor  # [T] int64 slot of each new token within its page
    stale: torch.Tensor  # [P, bs] bool: slot lies past the last one written this step

    @staticmethod
    def build(slot_mapping: torch.Tensor, block_size: int) -> "PageWrites":
        offsets = slot_mapping % block_size
        pages, page_index = torch.unique(slot_mapping // block_size, return_inverse=True)
        last = torch.full(pages.shape, -1, dtype=torch.long, device=pages.device)
        last.scatter_reduce_(0, page_index, offsets, reduce="amax")
        stale = torch.arange(block_size, device=pages.device) > last[:, None]
        return PageWrites(pages, page_index, offsets, stale)


class QuantizedPages:
    """One layer's keys (or values) in a quantised pool: `raw` [num_blocks, page_bytes] uint8.

    Paged attention dispatches on this type: `write` stores new tokens, `gather` returns pages dequantised
    to the serving dtype, laid out as indexing an unquantised [num_blocks, bs, H, D] cache would."""

    def __init__(self, raw: torch.Tensor, fmt: PageFormat, dtype: torch.dtype) -> None:
        self.raw = raw
        self.format = fmt
        self.dtype = dtype  # the serving dtype that gather returns
        self.block_size = fmt.page_shape[0]
        # Row copies: torch indexes 2-D tensors by rows far faster than 4-D ones, and int32 words 4x faster
        # than bytes, so fields are read as [N, nbytes] byte rows and pages written back as whole word rows.
        self.field_rows = [raw.narrow(1, f.offset, f.nbytes) for f in fmt.fields]  # [N, nbytes] each
        self.words = raw.view(torch.int32)  # [N, page_bytes / 4]

    def write(self, plan: PageWrites, x: torch.Tensor) -> None:
        """x [T, H, D]: the new tokens at plan's slots."""
        pages = self.dequantize(plan.pages, torch.float32)  # [P, bs, H, D]
        pages.masked_fill_(plan.stale[:, :, None, None], 0.0)
        pages[plan.page_index, plan.offsets] = x.to(torch.float32)
        self.words.index_copy_(0, plan.pages, self.encode(pages).view(torch.int32))

    def encode(self, pages: torch.Tensor) -> torch.Tensor:
        """pages [P, bs, H, D] (bf16 or fp32) -> [P, page_bytes] uint8 whole pages, one batched kernel call."""
        encoded = torch.zeros(len(pages), self.format.page_bytes, dtype=torch.uint8, device=pages.device)
        for f, new in zip(self.format.fields, self.format.quantize(pages)):
            encoded[:, f.offset:f.offset + f.nbytes] = new.reshape(len(pages), -1).view(torch.uint8)
        return encoded

    def gather(self, block_tables: torch.Tensor) -> torch.Tensor:
        """block_tables [B, nb] -> [B, nb, bs, H, D] in the serving dtype."""
        pages = self.dequantize(block_tables.reshape(-1), self.dtype)
        return pages.view(*block_tables.shape, *self.format.page_shape)

    def fields(self, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """block_ids [P] -> a contiguous copy of each field of those pages, [P, *field.shape]."""
        return [rows.index_select(0, block_ids).view(f.dtype).view(len(block_ids), *f.shape)
                for rows, f in zip(self.field_rows, self.format.fields)]

    def dequantize(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """block_ids [P] -> [P, bs, H, D] in `dtype`, one batched kernel call."""
        kernel_dtype = dtype if dtype in _KERNEL_DTYPES else torch.float32
        return self.format.dequantize(*self.fields(block_ids), dtype=kernel_dtype).to(dtype)
