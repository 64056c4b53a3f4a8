"""Vectorised numpy quantisers that write ggml's own block layouts: BF16, Q8_0, Q4_0, Q4_K and Q6_K.

`quantize(values, qtype)` turns float32 rows [rows, K] into that type's bytes [rows, K / block * type size], as
GGUFWriter takes them with `raw_dtype`. BF16, Q8_0 and Q4_0 follow ggml's reference quantisers step for step, so
their bytes equal `gguf.quants.quantize`'s. `gguf` has no K-quant quantiser; for Q4_K and Q6_K the layouts are
ggml's (`block_q4_K`, `block_q6_K`) and so are the rules that turn the sub-block scales into the stored 6- and
8-bit ones, but each sub-block's scale is the plain one (min-max for Q4_K, largest magnitude at -32 for Q6_K),
without llama.cpp's search for the scale of least weighted error: the values come out a little less exact than
llama-quantize's, and decode the same way. Used by bench/real_shapes.py for random weights, where that
accuracy does not matter; tests/test_real_shapes.py checks every type against `gguf.quants.dequantize`.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK = 32  # values per Q8_0 / Q4_0 block
QK_K = 256  # values per K-quant super-block
CHUNK_VALUES = 1 << 20  # values quantised at once: their float32 temporaries stay a few MiB


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [..., K] -> uint8 [..., K / block * type size], `qtype`'s blocks row by row."""
    if qtype not in QUANTIZERS:
        raise ValueError(f"no quantiser for {qtype.name}; expected one of {', '.join(t.name for t in QUANTIZERS)}")
    block, size = GGML_QUANT_SIZES[qtype]
    k = values.shape[-1]
    if k % block:
        raise ValueError(f"rows of {k} values do not split into {qtype.name} blocks of {block}")
    rows = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, k)
    out = np.empty((rows.shape[0], k // block * size), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // k)
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        out[start:start + step] = QUANTIZERS[qtype](chunk.reshape(-1, block)).reshape(chunk.shape[0], -1)
    return out.reshape(*values.shape[:-1], -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [n] -> [n, 2] uint8, each value as ggml's fp16 (round to nearest even)."""
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _round_away(values: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), exactly: adding 0.5 would round some values just below a half up."""
    magnitude = np.abs(values)
    whole = np.floor(magnitude)
    return np.sign(values) * (whole + np.floor(2 * (magnitude - whole)))


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (ggml's `id = d ? 1/d : 0`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d)


def _signed_peak(blocks: np.ndarray) -> np.ndarray:
    """Each row's value of largest magnitude, with its sign (the first on a tie), as a column."""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    # ggml_compute_fp32_to_bf16: NaNs made quiet, the rest rounded to nearest even
    bits = blocks.view(np.uint32)
    bits = np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits & 0xFFFF0000) | (64 << 16), bits)
    return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16).view(np.uint8)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # block_q8_0: d (fp16) = absmax / 127, then 32 int8 codes round(x / d)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    codes = _round_away(blocks * _inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), codes], axis=1)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # block_q4_0: d (fp16) = the signed peak / -8, then 16 bytes of codes q = x / d + 8 in 0..15: values 0-15 in
    # the low nibbles, 16-31 in the high ones
    d = _signed_peak(blocks) / np.float32(-8)
    codes = np.trunc(blocks * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    packed = codes[:, :QK // 2] | (codes[:, QK // 2:] << np.uint8(4))
    return np.concatenate([_f16_bytes(d), packed], axis=1)


def _six_bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's super-block scale for (n, 8) non-negative sub-block values: (d as fp16 [n], codes [n, 8] in 0..63),
    value ~ d * code, as ggml rounds them (nearest code of 63 / max, d = max / 63)."""
    peak = values.max(axis=1, keepdims=True)
    inverse = np.where(peak > 0, np.float32(63) / np.where(peak > 0, peak, 1), np.float32(0))
    codes = np.minimum(63, np.rint(inverse * values)).astype(np.uint8)
    return (peak[:, 0] / np.float32(63)).astype(np.float16), codes


def _codes(sub: np.ndarray, step: np.ndarray) -> np.ndarray:
    """round(x / step) for (n, sub-blocks, values) over (n, sub-blocks) steps, as ggml's nearest_int (halves to
    even); 0 in a sub-block whose step is 0."""
    nonzero = (step != 0)[..., None]
    return np.where(nonzero, np.rint(sub / np.where(nonzero, step[..., None], 1)), 0)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums -> ggml's 12 bytes: bytes 0-3 scales 0-3, 4-7 minimums 0-3, 8-11 the low
    nibbles of scale and minimum 4+i, whose top 2 bits go to the top of bytes i and 4+i."""
    packed = np.empty((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return packed


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K: d, dmin (fp16), 12 bytes of 6-bit sub-scales and minimums, 128 bytes of codes; value of code q in
    # sub-block j: d * scale_j * q - dmin * min_j. Each 32-value sub-block maps its range [min(lowest, 0), highest]
    # onto codes 0..15.
    sub = blocks.reshape(-1, 8, 32)  # (super-blocks, sub-blocks, values)
    low = np.minimum(sub.min(axis=2), 0)
    d, scales = _six_bit((sub.max(axis=2) - low) / np.float32(15))
    dmin, mins = _six_bit(-low)
    step = d.astype(np.float32)[:, None] * scales  # as ggml decodes them
    offset = dmin.astype(np.float32)[:, None] * mins
    codes = _codes(sub + offset[..., None], step).clip(0, 15).astype(np.uint8)
    pairs = codes.reshape(-1, 4, 2, 32)  # each 64 values: the first 32 in low nibbles, the next 32 in high ones
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << np.uint8(4))).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins), packed], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # block_q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 sub-scales, d (fp16); value of
    # code q in sub-block j: d * scale_j * (q - 32). Each 16-value sub-block puts its signed peak at code 0.
    sub = blocks.reshape(-1, 16, 16)
    scale = _signed_peak(sub)[..., 0] / np.float32(-32)  # (super-blocks, 16)
    peak = _signed_peak(scale)  # the sub-scale of largest magnitude, signed, as a column
    inverse = np.where(peak != 0, np.float32(-128) / np.where(peak != 0, peak, 1), np.float32(0))
    scales = np.minimum(127, np.rint(inverse * scale)).astype(np.int8)
    d = (_inverse(inverse)[:, 0]).astype(np.float16)
    step = d.astype(np.float32)[:, None] * scales
    codes = (_codes(sub, step).clip(-32, 31) + 32).astype(np.uint8)
    return np.concatenate([_pack_q6_codes(codes.reshape(-1, 2, 4, 32)), scales.view(np.uint8), _f16_bytes(d)],
                          axis=1)


def _pack_q6_codes(codes: np.ndarray) -> np.ndarray:
    """(n, 2 halves, 4 quarters, 32) 6-bit codes -> 128 bytes of low nibbles, 64 of high bits. Per half: quarters 0
    and 2 share 32 bytes (low and high nibble), so do 1 and 3; one byte holds the top 2 bits of all four."""
    low = codes & np.uint8(0x0F)
    nibbles = low[:, :, :2] | (low[:, :, 2:] << np.uint8(4))  # (n, 2, 2, 32)
    high = codes >> np.uint8(4)
    tops = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # (n, 2, 32)
    return np.concatenate([nibbles.reshape(-1, 128), tops.reshape(-1, 64)], axis=1)


QUANTIZERS: MappingProxyType[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = MappingProxyType({
    Q.BF16: _bf16, Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k,
})
