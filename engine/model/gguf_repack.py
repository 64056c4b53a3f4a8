"""GGUF's 4-bit blocks as int4 weights without dequantising them: the codes moved into the int4 format's bytes and
the block scales into its fp16 scale s and offset z per group of 32 (engine/backends/weight_ops.py: W = s q + z).

- Q4_0: 18-byte blocks of 32 values, d (fp16) then 16 bytes of nibbles; W = d (q - 8): s = d, z = -8 d. -8 d is
  exact in fp16 (d times a power of two) unless |d| > 65504 / 8, where it overflows.
- Q4_1: 20-byte blocks, d and m (fp16) then the nibbles; W = d q + m: s = d, z = m, both as stored.
- Q4_K: 144-byte super-blocks of 256 values, d and dmin (fp16), eight 6-bit scales sc and minimums m (12 bytes),
  128 bytes of nibbles; each 32-value sub-block is W = (d sc) q - dmin m: s = d sc, z = -dmin m, each rounded once
  to fp16. The products are exact in fp32 (11 by 6 significant bits) but fit fp16's 11 only where d's significand
  times sc's odd part still does (with d = k 2^e and sc = j 2^f, k and j odd: exact iff k j < 2^11, and the
  product within fp16's range and its subnormals' step); likewise dmin and m. sc a power of two is always exact;
  a full 11-bit significand times an odd sc > 1 never is, and real files' d have full significands: nearly every
  group rounds. A value then moves by at most half an fp16 step of s per code (q ulp(s) / 2, under 1% of s) plus
  half a step of z. `Int4Repack.inexact` counts the groups so rounded.

Both Q4 block layouts keep value i of a 32-value group in the low nibble of byte i and value i + 16 in its high
nibble (i < 16), which is the int4 format's byte for that row and group (quant.pack_int4): Q4_0 / Q4_1 bytes go
across unchanged. Q4_K keeps a pair of sub-blocks in 32 bytes, the first's values in the low nibbles and the
second's in the high ones, so its nibbles are regrouped.

The int4 products compute s q + z in fp32 (int4_rows, int4_linear.cpp): s q is exact (11 by 4 bits) and the sum
rounds once, as gguf's d (q - 8) (exact), d q + m and (d sc) q - dmin m (one rounding each) do. Where s and z are
the file's own values the int4 weight is the file's weight bit for bit, a zero's sign aside (8 d - 8 d is +0 where
gguf's 0 d may be -0).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.model.gguf_file import k_scales_mins

T = GGMLQuantizationType
GROUP = 32  # values per int4 group: a Q4_0 / Q4_1 block, a Q4_K sub-block
GROUP_BYTES = GROUP // 2
LOW_NIBBLES, HIGH_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0xF0F0F0F0F0F0F0F0)


class Int4Repack(NamedTuple):
    """A tensor's rows in the int4 format, as numpy arrays."""

    codes: np.ndarray  # uint8 [R, G, 16]: byte i of group g holds k = 32 g + i (low nibble) and 32 g + 16 + i (high)
    scale: np.ndarray  # fp16 [R, G]
    offset: np.ndarray  # fp16 [R, G]
    inexact: int  # groups whose s or z the file holds more exactly than fp16 (finite ones, rounded to nearest)
    overflowed: int  # groups whose finite s or z exceeds fp16's range: the int4 format cannot hold their values


def repack_int4(data: np.ndarray, ggml_type: GGMLQuantizationType) -> Int4Repack:
    """The rows of a 2-D tensor of `ggml_type` blocks (uint8 [R, bytes per row], as GGUFFile.tensor_data gives
    them) in the int4 format."""
    repack = REPACKERS.get(ggml_type)
    if repack is None:
        raise ValueError(f"GGUF type {ggml_type.name} has no int4 repack; expected one of "
                         f"{', '.join(t.name for t in REPACKERS)}")
    rows, (_, type_size) = data.shape[0], GGML_QUANT_SIZES[ggml_type]
    codes, exact_scale, exact_offset = repack(np.ascontiguousarray(data).reshape(-1, type_size))
    with np.errstate(over="ignore"):  # counted below
        scale, offset = exact_scale.astype(np.float16), exact_offset.astype(np.float16)
    finite = np.isfinite(exact_scale) & np.isfinite(exact_offset)
    kept = np.isfinite(scale) & np.isfinite(offset)
    rounded = (scale.astype(np.float32) != exact_scale) | (offset.astype(np.float32) != exact_offset)
    return Int4Repack(codes.reshape(rows, -1, GROUP_BYTES), scale.reshape(rows, -1), offset.reshape(rows, -1),
                      int(np.count_nonzero(finite & kept & rounded)), int(np.count_nonzero(finite & ~kept)))


Repacker = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start:start + 2].view("<f2").astype(np.float32)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> codes [B, 1, 16], s and z [B, 1] float32 (exact)."""
    d = _f16(blocks, 0)
    return blocks[:, 2:2 + GROUP_BYTES].reshape(-1, 1, GROUP_BYTES), d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return blocks[:, 4:4 + GROUP_BYTES].reshape(-1, 1, GROUP_BYTES), _f16(blocks, 0), _f16(blocks, 2)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> codes [B, 8, 16], s and z [B, 8] float32 (the products, exact). Bytes 32 j + i and 32 j + 16 + i (i < 16)
    hold values i and i + 16 of sub-block 2 j in their low nibbles, and of sub-block 2 j + 1 in their high ones.
    Done on uint64 words (8 bytes each), as numpy's loops over uint8 are slow."""
    pairs = np.ascontiguousarray(blocks[:, 16:144]).view("<u8").reshape(-1, 4, 2, 2)  # [B, j, first / second 16 B, w]
    first, second = pairs[:, :, 0], pairs[:, :, 1]
    codes = np.empty((blocks.shape[0], 4, 2, 2), dtype="<u8")
    codes[:, :, 0] = (first & LOW_NIBBLES) | ((second & LOW_NIBBLES) << np.uint64(4))
    codes[:, :, 1] = ((first >> np.uint64(4)) & LOW_NIBBLES) | (second & HIGH_NIBBLES)
    scales, minimums = k_scales_mins(blocks[:, 4:16])
    return codes.view(np.uint8).reshape(-1, 8, GROUP_BYTES), _f16(blocks, 0) * scales, -(_f16(blocks, 2) * minimums)


REPACKERS: MappingProxyType[GGMLQuantizationType, Repacker] = MappingProxyType({
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k})
