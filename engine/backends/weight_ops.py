"""The weight formats a backend runs products on, and the plain-torch products on them: a float weight, int8 codes
with one fp32 scale per output channel, and int4 codes (two per byte, in the decode kernel's layout) with an fp16
scale and offset per group of 32 along K. How a model's weights are quantised into these formats is model-layout
code (engine/model/quant.py); this module only reads them.

int8: W ~ Q * s[n]. A product reads Q and applies s to its fp32 sums: x W^T ~ (x Q^T) * s. The CPU kernels
(engine/kernels/int8_linear.cpp) do that for decode-sized row counts: on AVX-512 VNNI against x quantised to int8
in groups of 32 (`W8A8_GROUP`), on the copy of Q `pack_w8a8` makes once per model; elsewhere on Q widened to fp32.
Larger row counts (and every other backend) dequantise Q * s to the activations' dtype and run F.linear
(`dequantize`, `linear_int8`).

int4: W ~ s * q + z per group of 32 consecutive k, the codes in `int4_shapes`' layout (engine/kernels/
int4_linear.cpp). Decode-sized products run W4A8 on VNNI, larger ones and every other backend dequantise at most
DEQUANT_CHUNK_ROWS rows at a time to the activations' dtype for F.linear (`linear_int4`).

int8g: int8 codes q with, per group of 16 consecutive k, an fp32 scale s and (for the GGUF types with minimums)
an fp32 offset z; W = s q (+ z), a file's values exactly (engine/model/gguf_int8g.py), never rounded in the
products. The codes lie in blocks of 16 output channels, [ceil(N / 16), G, 256] (`int8g_shapes`, `int8g_pack`):
32 bytes hold one pair of k of a group for the block's 16 channels side by side, so the kernels widen them to
vectors of channels without a transpose; scales fp32 [1, G, N] (s) or [2, G, N] (s, z) as filled, then one per
32 values where a file's factors hold for 32 (`pair_int8g_scales`) and in the codes' blocks, [N / 16, G', S, 16],
where N allows (`block_int8g_scales`). Decode-sized products run on the codes widened in registers, many rows on
bf16 dot products (engine/kernels/int8_grouped.cpp); larger ones and every other backend dequantise chunks of rows
to the activations' dtype for F.linear (`linear_int8g`).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F

DEQUANT_CHUNK_ROWS = 8192  # F.linear on at most this many dequantised output channels at once (the LM head's 49k)
W8A8_GROUP = 32  # activation codes per scale in the W8A8 kernel (its packed copy pads K to a multiple)
W8A8_CHANNELS = 16  # output channels per packed block: one int32 lane each
INT4_GROUP = 32  # weights per scale and offset along K (GGUF's Q4 block), and activations per scale in W4A8
INT4_CHANNELS = 16  # output channels per packed block: one int32 lane each
INT8G_GROUP = 16  # int8g weights per group of codes along K, and per scale (and offset) unless paired
INT8G_CHANNELS = 16  # int8g output channels per block of codes


@dataclass(frozen=True, eq=False)
class Weight:
    """One product's weight as a backend runs it: the model's tensors and the backend's copies of them."""

    data: torch.Tensor  # [N, K] float; int8 codes [N, K]; int4 codes in int4_shapes' layout (uint8)
    _: KW_ONLY
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # int8: [N] fp32; int4: int4_shapes'; int8g: fp32, 3-D or blocked; float: None
    packed: torch.Tensor | None = None  # the backend's copy: of a bf16 weight (blocks or oneDNN's), or int8's W8A8
    silu_fused: torch.Tensor | None = None  # a gate|up weight's interleaved blocks, for silu(gate) * up as one product


def pack_w8a8(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8 -> the W8A8 kernel's copy, uint8 [ceil(N / 16), ceil(K / 32) * 8, 16, 4]:
    packed[b, j, c, t] = codes[16 b + c, 4 j + t] + 128 (0 + 128 past N and K). One 64-byte vector holds 4
    consecutive k of 16 channels, unsigned as vpdpbusd's first operand must be."""
    n, k = codes.shape
    blocks, kp = -(-n // W8A8_CHANNELS), -(-k // W8A8_GROUP) * W8A8_GROUP
    padded = torch.zeros(blocks * W8A8_CHANNELS, kp, dtype=torch.int16)
    padded[:n, :k] = codes
    shifted = (padded + 128).to(torch.uint8)
    return shifted.view(blocks, W8A8_CHANNELS, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] int8, scale [N] fp32 -> codes * scale [N, K] in `dtype`, one rounding per element (the
    codes are exact in bf16). decode_stack.cpp's prefill path computes the same."""
    return codes.to(dtype).mul_(scale.unsqueeze(1))


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                dequantize_rows=None) -> torch.Tensor:
    """x [M, K] -> x (codes * scale)^T + bias [M, N] by F.linear on the weight dequantised to x's dtype, at most
    DEQUANT_CHUNK_ROWS output channels at a time (so that the transient copy stays small). `dequantize_rows(begin,
    end)` makes a chunk (default: `dequantize` of those rows)."""
    if dequantize_rows is None:
        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return dequantize(codes[begin:end], scale[begin:end], x.dtype)
    return _chunked_linear(x, codes.shape[0], bias, dequantize_rows)


def _chunked_linear(x: torch.Tensor, n: int, bias: torch.Tensor | None, dequantize_rows) -> torch.Tensor:
    """x W^T + bias [M, n] by F.linear on DEQUANT_CHUNK_ROWS output channels of W at a time."""
    parts = [F.linear(x, dequantize_rows(i, min(n, i + DEQUANT_CHUNK_ROWS)),
                      None if bias is None else bias[i:i + DEQUANT_CHUNK_ROWS])
             for i in range(0, n, DEQUANT_CHUNK_ROWS)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                rows_fp32=None) -> torch.Tensor:
    """x W^T [M, N] in fp32 for a float weight, or an int8 (scale [N]) or int4 one (int4_shapes' scales): F.linear in
    fp32 on at most DEQUANT_CHUNK_ROWS output channels widened or dequantised to fp32 at a time, each made by
    `rows_fp32(begin, end)` (default: weight_rows_fp32's)."""
    x = x.float()
    if rows_fp32 is None:
        rows_fp32 = weight_rows_fp32(weight, scale, x.shape[-1])
    n = output_channels(weight, scale)
    return _chunked_linear(x, n, None, rows_fp32)


def weight_rows_fp32(weight: torch.Tensor, scale: torch.Tensor | None, k: int):
    """(begin, end) -> output channels [begin, end) of a float, int8 or int4 weight of K columns in fp32 (the
    quantised ones dequantised: exact for int8, one rounding of s * q + z for int4)."""
    if scale is None:
        return lambda begin, end: weight[begin:end].float()
    if is_int4(weight):
        return lambda begin, end: int4_rows(weight, scale, torch.arange(begin, end, device=weight.device), k,
                                            torch.float32)
    if is_int8g(weight, scale):
        return lambda begin, end: int8g_rows(weight, scale, slice(begin, end), k, torch.float32)
    return lambda begin, end: dequantize(weight[begin:end], scale[begin:end], torch.float32)


def embed_int8(codes: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` from an int8 table: codes[ids] * scale[ids] in `dtype`."""
    return codes[ids].to(dtype).mul_(scale[ids].unsqueeze(1))


def int4_shapes(n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of an int4 weight [N, K]: codes uint8 [ceil(N / 16), G, 4, 16, 4], byte [b, g, t, c, j] holding
    channel 16 b + c's k = 32 g + 4 t + j (low nibble) and k + 16 (high); scales and offsets fp16, where N is a
    multiple of 16 blocked as the codes are, [N / 16, G, 2, 16] (s of channel 16 b + c at [b, g, 0, c], z at [b, g,
    1, c]: a one-row product streams them beside the codes, int4_linear.cpp), else [2, G, N]."""
    groups = -(-k // INT4_GROUP)
    blocks = -(-n // INT4_CHANNELS)
    scales = (blocks, groups, 2, INT4_CHANNELS) if n % INT4_CHANNELS == 0 else (2, groups, n)
    return (blocks, groups, 4, INT4_CHANNELS, 4), scales


def int4_channels(scales: torch.Tensor) -> int:
    """An int4 weight's output channels N, from its scales (either of int4_shapes' layouts)."""
    return scales.shape[0] * INT4_CHANNELS if scales.dim() == 4 else scales.shape[2]


def int4_scales_of(scales: torch.Tensor, rows: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales and offsets [len(rows), G] (fp16) of output channels `rows` of an int4 weight."""
    if scales.dim() == 3:
        return scales[0, :, rows].T, scales[1, :, rows].T
    if isinstance(rows, slice):
        rows = torch.arange(int4_channels(scales), device=scales.device)[rows]
    block, lane = rows // INT4_CHANNELS, rows % INT4_CHANNELS
    return scales[block, :, 0, lane], scales[block, :, 1, lane]


def unpack_int4(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The codes [len(rows), G * 32] uint8 of output channels `rows` (int64) of a weight in int4_shapes' layout."""
    picked = packed[rows // INT4_CHANNELS, :, :, rows % INT4_CHANNELS, :]  # [R, G, 4, 4]
    return torch.stack([picked & 0x0F, picked >> 4], dim=2).view(len(rows), -1)


def int4_rows(packed: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, k: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Output channels `rows` of an int4 weight of K columns, dequantised: (s * q + z) [len(rows), K] in `dtype`,
    one rounding of s * q + z in fp32 (s * q is exact) and one to `dtype`, as int4_linear.cpp's dequantize_int4."""
    codes = unpack_int4(packed, rows).view(len(rows), -1, INT4_GROUP).float()
    s, z = (part.float().unsqueeze(2) for part in int4_scales_of(scales, rows))
    return (codes * s + z).view(len(rows), -1)[:, :k].to(dtype)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                dequantize_rows=None) -> torch.Tensor:
    """x [M, K] -> x W^T + bias [M, N] for an int4 weight, by F.linear on at most DEQUANT_CHUNK_ROWS output
    channels dequantised at a time (to x's dtype). `dequantize_rows(begin, end)` makes a chunk (default: torch's
    int4_rows; the CPU backend passes its kernel's, the same bits)."""
    n, k = int4_channels(scales), x.shape[-1]
    if dequantize_rows is None:
        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return int4_rows(packed, scales, torch.arange(begin, end, device=packed.device), k, x.dtype)
    return _chunked_linear(x, n, bias, dequantize_rows)


def embed_int4(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` from an int4 table, dequantised to `dtype`."""
    return int4_rows(packed, scales, ids.reshape(-1), k, dtype).view(*ids.shape, k)


def int8g_shapes(n: int, k: int, offsets: bool) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of an int8g weight [N, K] as it is filled: codes int8 [ceil(N / 16), G, 256], scales (and offsets)
    fp32 [1 or 2, G, N]. After the load the scales may be paired (pair_int8g_scales) and blocked
    (block_int8g_scales); the kernels and int8g_rows take every form."""
    groups = -(-k // INT8G_GROUP)
    return (-(-n // INT8G_CHANNELS), groups, INT8G_CHANNELS * INT8G_GROUP), (2 if offsets else 1, groups, n)


def int8g_scale_group(scales: torch.Tensor, k: int) -> int:
    """The values along K that an int8g weight of K columns holds per scale (and offset): 16 where its scales are
    [S, ceil(K / 16), N] (or blocked [N / 16, ceil(K / 16), S, 16]), 32 where ceil(K / 32) (pair_int8g_scales)."""
    for group in (INT8G_GROUP, 2 * INT8G_GROUP):
        if scales.shape[1] == -(-k // group):
            return group
    raise ValueError(f"int8g scales {tuple(scales.shape)} fit neither 16 nor 32 values a scale for K = {k}")


def pair_int8g_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """int8g scales and offsets [S, G, N] per group of 16 as [S, ceil(G / 2), N] per 32 values where each pair of
    groups holds the same bits (a file's types whose factors hold for 32 values: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
    K-quants with 32-value sub-blocks), else None. A Q8_0 weight then reads 1.125 bytes a value, not 1.25."""
    groups = scales.shape[1]
    if groups < 2:
        return None
    bits = scales.view(torch.int32)
    whole = groups // 2 * 2
    if not torch.equal(bits[:, 0:whole:2], bits[:, 1:whole:2]):
        return None
    return scales[:, 0::2].contiguous()


def block_int8g_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """int8g scales and offsets [S, G', N] as the codes' blocks hold their channels, [N / 16, G', S, 16], where N is
    a multiple of 16 (else None): a block's scales then stream beside its codes (int8_grouped.cpp)."""
    count, groups, n = scales.shape
    if n % INT8G_CHANNELS:
        return None
    return scales.view(count, groups, n // INT8G_CHANNELS, INT8G_CHANNELS).permute(2, 1, 0, 3).contiguous()


def int8g_flat_shape(scales: torch.Tensor) -> tuple[int, int, int]:
    """(S, G', N) of an int8g weight's scales, whichever form they are held in."""
    if scales.dim() == 3:
        return tuple(scales.shape)
    blocks, groups, count, _ = scales.shape
    return count, groups, blocks * INT8G_CHANNELS


def int8g_channels(scales: torch.Tensor) -> int:
    """N, the output channels of an int8g weight, from its scales [1 or 2, G', N] or [N / 16, G', 1 or 2, 16]."""
    return scales.shape[0] * INT8G_CHANNELS if scales.dim() == 4 else scales.shape[2]


def _int8g_blocks(codes: torch.Tensor) -> torch.Tensor:
    """An int8g weight's codes [Nb, G, 256] as [Nb, G, 8 pairs, 16 channels, 2]."""
    return codes.view(codes.shape[0], codes.shape[1], INT8G_GROUP // 2, INT8G_CHANNELS, 2)


def whole_blocks(first: int, n: int, channels: int) -> tuple[int, int]:
    """Of n output channels put from channel `first` into a weight held in blocks of `channels`: the ones
    [start, stop) that fill whole blocks (a strided copy moves them; those before and after go by index)."""
    start = min(n, -first % channels)
    return start, start + (n - start) // channels * channels


def int8g_put(codes: torch.Tensor, scales: torch.Tensor, first: int, rows: torch.Tensor, scale: torch.Tensor,
              offset: torch.Tensor | None) -> None:
    """Output channels first..first+R of an int8g weight from their codes int8 [R, K'] (K' <= G * 16), scales fp32
    [R, G] and offsets [R, G] (None: left as they are): whole 16-channel blocks by one strided copy (two codes, an
    int16, at a time), the channels around them by index."""
    n, groups = rows.shape[0], codes.shape[1]
    padded = torch.zeros(n, groups * INT8G_GROUP, dtype=torch.int8, device=codes.device)
    padded[:, :rows.shape[1]] = rows
    pairs = padded.view(torch.int16).view(n, groups, INT8G_GROUP // 2)  # [R, G, 8 pairs]
    target = _int8g_blocks(codes).view(torch.int16).squeeze(-1)  # [Nb, G, 8 pairs, 16 channels]
    start, stop = whole_blocks(first, n, INT8G_CHANNELS)
    if stop > start:
        block, blocks = (first + start) // INT8G_CHANNELS, (stop - start) // INT8G_CHANNELS
        target[block:block + blocks] = pairs[start:stop].view(blocks, INT8G_CHANNELS, groups, -1).permute(0, 2, 3, 1)
    for lo, hi in ((0, start), (stop, n)):
        channels = torch.arange(first + lo, first + hi, device=codes.device)
        target[channels // INT8G_CHANNELS, :, :, channels % INT8G_CHANNELS] = pairs[lo:hi]
    scales[0, :, first:first + n] = scale.t()
    if offset is not None:
        scales[1, :, first:first + n] = offset.t()


def int8g_pack(rows: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole int8g weight of K columns from its channels' codes int8 [N, K'] (K' <= G * 16), scales fp32 [N, G]
    and offsets [N, G] or None -> (codes, scales [1 or 2, G, N])."""
    codes_shape, scales_shape = int8g_shapes(rows.shape[0], k, offsets=offset is not None)
    codes = torch.zeros(codes_shape, dtype=torch.int8)
    scales = torch.zeros(scales_shape, dtype=torch.float32)
    int8g_put(codes, scales, 0, rows, scale, offset)
    return codes, scales


def int8g_rows(codes: torch.Tensor, scales: torch.Tensor, rows: slice | torch.Tensor, k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Output channels `rows` of an int8g weight of K columns, dequantised: s q (+ z) [R, K] in `dtype`, the fp32
    value rounded once (s q is exact), then to `dtype`, as int8_grouped.cpp computes it."""
    if isinstance(rows, slice):
        rows = torch.arange(*rows.indices(int8g_channels(scales)), device=codes.device)
    picked = _int8g_blocks(codes)[rows // INT8G_CHANNELS, :, :, rows % INT8G_CHANNELS, :]  # [R, G, 8, 2]
    if scales.dim() == 4:  # blocked
        factors = scales[rows // INT8G_CHANNELS, :, :, rows % INT8G_CHANNELS].permute(2, 0, 1)  # [S, R, G']
    else:
        factors = scales[:, :, rows].transpose(1, 2)
    if int8g_scale_group(scales, k) != INT8G_GROUP:
        factors = factors.repeat_interleave(2, dim=2)[:, :, :codes.shape[1]]
    values = picked.float().view(rows.shape[0], -1, INT8G_GROUP) * factors[0].unsqueeze(2)
    if factors.shape[0] == 2:
        values += factors[1].unsqueeze(2)
    return values.view(rows.shape[0], -1)[:, :k].to(dtype)


def linear_int8g(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dequantize_rows=None) -> torch.Tensor:
    """x [M, K] -> x W^T + bias [M, N] for an int8g weight, by F.linear on at most DEQUANT_CHUNK_ROWS output
    channels dequantised at a time (to x's dtype); `dequantize_rows(begin, end)` makes a chunk."""
    k = x.shape[-1]
    if dequantize_rows is None:
        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return int8g_rows(codes, scales, slice(begin, end), k, x.dtype)
    return _chunked_linear(x, int8g_channels(scales), bias, dequantize_rows)


def embed_int8g(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, k: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` from an int8g table, dequantised exactly (then to `dtype`)."""
    flat = ids.reshape(-1)
    return int8g_rows(codes, scales, flat, k, dtype).view(*ids.shape, k)


def output_channels(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """N, the output channels of a weight in any format (int4 and int8g hold theirs in blocks of 16)."""
    if scale is not None and is_int4(weight):
        return int4_channels(scale)
    if is_int8g(weight, scale):
        return int8g_channels(scale)
    return weight.shape[0]


def weight_format(weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    """"bf16" for a float weight (of any float dtype), "int8", "int4" or "int8g" for a quantised one: a dispatch
    table's formats (engine/backends/dispatch.py)."""
    if scale is None:
        return "bf16"
    return "int4" if is_int4(weight) else "int8g" if is_int8g(weight, scale) else "int8"


def is_int8g(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether a weight is int8g: int8 codes with grouped fp32 scales (3 or 4 dimensions; int8's are [N])."""
    return scale is not None and weight.dtype == torch.int8 and scale.dim() in (3, 4)


def is_int4(weight: torch.Tensor) -> bool:
    """Whether a quantised weight (one with scales) is int4 (int4_shapes' uint8 layout) rather than int8."""
    return weight.dtype == torch.uint8
