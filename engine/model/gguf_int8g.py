"""GGUF's quantised blocks as int8g weights without a second rounding: each block's integer codes as int8, and per
group of 16 values along K an fp32 scale s and, for the types with minimums, an fp32 offset z, so that a value is
s q (types without minimums) or s q + z rounded once in fp32 (engine/backends/weight_ops.py int8g).

That is gguf's own dequantisation (gguf.quants) bit for bit, for every type here:
- Q8_0, Q4_0, Q5_0: d (q - c) with d fp16 and |q - c| < 2^7: s = d, the product exact in fp32 either way.
- Q4_1, Q5_1: d q + m, gguf's float32 (d q) + m: s = d, z = m; d q is exact, so both round the sum once.
- Q2_K, Q4_K, Q5_K: (d sc) q - dmin m, sc and m 4- or 6-bit: d sc (at most 17 significant bits) and its product
  with q (at most 5 more) are exact in fp32, as is -(dmin m): s = d sc, z = -(dmin m), one rounding of the sum.
- Q3_K, Q6_K: (d sc) q with sc a signed 6- or 8-bit scale and q a signed 3- or 6-bit code: every product exact
  (at most 11 + 7 + 5 = 23 significant bits): s = d sc.
Q8_0's and the 5/4-bit types' scales hold for 32 values, the K-quants' for 16 or 32: a scale of 32 values is
written for both of its groups of 16. A group of 16 never straddles two blocks (every block is 32 or 256 values).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.model.gguf_file import (_block_scale, _bit_planes, _crumbs, _five_bits, _nibbles, _q3_k_scales, _signed,
                                    _unpack_nibbles, k_scales_mins)

T = GGMLQuantizationType
GROUP = 16  # values per int8g scale and offset


class Int8gRepack(NamedTuple):
    """A tensor's rows in the int8g format, as numpy arrays."""

    codes: np.ndarray  # int8 [R, K]
    scale: np.ndarray  # float32 [R, K / 16]
    offset: np.ndarray | None  # float32 [R, K / 16], or None for the types without minimums


Parts = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # codes int8 [B, V], scale and offset [B, groups]


def repack_int8g(data: np.ndarray, ggml_type: GGMLQuantizationType) -> Int8gRepack:
    """The rows of a 2-D tensor of `ggml_type` blocks (uint8 [R, bytes per row], as GGUFFile.tensor_data gives
    them) in the int8g format."""
    split = SPLITTERS.get(ggml_type)
    if split is None:
        raise ValueError(f"GGUF type {ggml_type.name} has no int8g repack; expected one of "
                         f"{', '.join(t.name for t in SPLITTERS)}")
    rows, (_, type_size) = data.shape[0], GGML_QUANT_SIZES[ggml_type]
    codes, scale, offset = split(np.ascontiguousarray(data).reshape(-1, type_size))
    scale, offset = (None if a is None else _per_group(a, codes.shape[1]) for a in (scale, offset))
    return Int8gRepack(codes.reshape(rows, -1), scale.reshape(rows, -1),
                       None if offset is None else offset.reshape(rows, -1))


def _per_group(factors: np.ndarray, values: int) -> np.ndarray:
    """A block's factors (one per equal run of its values) repeated to one per group of 16."""
    return np.ascontiguousarray(factors.astype(np.float32).repeat(values // GROUP // factors.shape[1], axis=1))


def _q8_0(blocks: np.ndarray) -> Parts:
    return blocks[:, 2:].view(np.int8).copy(), _block_scale(blocks, 0), None


def _q4_0(blocks: np.ndarray) -> Parts:
    return _signed(_nibbles(blocks, 2), 8), _block_scale(blocks, 0), None


def _q4_1(blocks: np.ndarray) -> Parts:
    return _nibbles(blocks, 4).view(np.int8), _block_scale(blocks, 0), _block_scale(blocks, 2)


def _q5_0(blocks: np.ndarray) -> Parts:
    return _signed(_five_bits(blocks, 2, 6), 16), _block_scale(blocks, 0), None


def _q5_1(blocks: np.ndarray) -> Parts:
    return _five_bits(blocks, 4, 8).view(np.int8), _block_scale(blocks, 0), _block_scale(blocks, 2)


def _q2_k(blocks: np.ndarray) -> Parts:
    codes = _crumbs(blocks[:, 16:80], 2).reshape(-1, 256)
    scales = blocks[:, :16]
    return (codes.view(np.int8), _block_scale(blocks, 80) * (scales & 0x0F),
            -(_block_scale(blocks, 82) * (scales >> 4)))


def _q3_k(blocks: np.ndarray) -> Parts:
    q = _crumbs(blocks[:, 32:96], 2).reshape(-1, 256)
    q |= _bit_planes(blocks[:, :32], 4).reshape(-1, 256)
    return _signed(q, 4), _block_scale(blocks, 108) * _q3_k_scales(blocks[:, 96:108]), None


def _k_parts(blocks: np.ndarray, q: np.ndarray) -> Parts:
    scales, minimums = k_scales_mins(blocks[:, 4:16])
    return q.view(np.int8), _block_scale(blocks, 0) * scales, -(_block_scale(blocks, 2) * minimums)


def _q4_k(blocks: np.ndarray) -> Parts:
    q = np.empty((blocks.shape[0], 256), dtype=np.uint8)
    _unpack_nibbles(blocks[:, 16:], q, groups=4)
    return _k_parts(blocks, q)


def _q5_k(blocks: np.ndarray) -> Parts:
    q = np.empty((blocks.shape[0], 256), dtype=np.uint8)
    _unpack_nibbles(blocks[:, 48:], q, groups=4)
    q |= _bit_planes(blocks[:, 16:48], 16).reshape(q.shape)
    return _k_parts(blocks, q)


def _q6_k(blocks: np.ndarray) -> Parts:
    q = np.empty((blocks.shape[0], 256), dtype=np.uint8)
    _unpack_nibbles(blocks[:, :128], q, groups=2)
    high = _crumbs(blocks[:, 128:192], 2)
    high *= np.uint8(16)
    q |= high.reshape(q.shape)
    return _signed(q, 32), _block_scale(blocks, 208) * blocks[:, 192:208].view(np.int8), None


SPLITTERS: MappingProxyType[GGMLQuantizationType, Callable[[np.ndarray], Parts]] = MappingProxyType({
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q2_K: _q2_k, T.Q3_K: _q3_k,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k})
