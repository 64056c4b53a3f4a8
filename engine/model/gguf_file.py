"""A fast, pure-Python reader for GGUF files (llama.cpp's format), versions 2 and 3, little-endian only.

`GGUFFile(path)` parses the header, every metadata key/value and every tensor info up front, which takes a
under 0.1 s for a 50k-token vocabulary and 50k merges (`gguf.GGUFReader` takes seconds), and memory-maps the
file once; `tensor_data` returns read-only views into that map.

Metadata values are plain Python objects: int, float, bool or str, and every array, whatever its size, a
list of those (a list of lists for arrays of arrays). Strings are UTF-8 with invalid bytes replaced.

`dequantize` turns tensor data into float32, bit-identical to `gguf.quants.dequantize`, with vectorised
paths (FAST_DEQUANTIZERS) for F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K, Q3_K,
Q4_K, Q5_K and Q6_K; gguf's own splits every tensor into 16-row groups. Each fast path decodes a chunk of
blocks at a time with the same float32 operations, in the same order, as gguf's, so that every rounding
matches. Other types (IQ*, TQ*, ...) go to gguf's own dequantiser.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.model.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
V = GGUFValueType
T = GGMLQuantizationType
SCALAR_FORMATS = MappingProxyType({  # struct codes, little-endian
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i", V.UINT64: "<Q",
    V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<?",
})
SCALAR_STRUCTS = MappingProxyType({kind: struct.Struct(code) for kind, code in SCALAR_FORMATS.items()})
NUMERIC_DTYPES = MappingProxyType({kind: np.dtype(code) for kind, code in SCALAR_FORMATS.items()})
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
BLOCK_VALUES = 32  # values per block of Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1
QK_K = 256  # values per super-block of the K-quants
CHUNK_VALUES = 1 << 18  # values decoded per chunk: a MiB of float32, which stays in cache between passes
LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
# Tensor types `gguf.GGUFReader` exposes as typed elements; every other type comes as raw bytes per row.
ELEMENT_DTYPES = MappingProxyType({
    T.F32: np.dtype("<f4"), T.F16: np.dtype("<f2"), T.F64: np.dtype("<f8"), T.I8: np.dtype("<i1"),
    T.I16: np.dtype("<i2"), T.I32: np.dtype("<i4"), T.I64: np.dtype("<i8"),
})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: GGUF's own dimension list reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the tensor's data in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return prod(self.shape)


class GGUFFile:
    """One GGUF file: `version`, `metadata` (key -> Python value, in file order), `tensors` (in file order)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._bytes = _map_file(self.path)
        parser = _Parser(memoryview(self._bytes), self.path)
        try:
            self.version, tensor_count, kv_count = parser.preamble()
            self.metadata: dict[str, Any] = parser.metadata(kv_count)
            raw_tensors = parser.tensor_infos(tensor_count)
        except (struct.error, OverflowError, RecursionError) as exc:  # reads past the end, or absurd lengths
            raise parser.truncated() from exc
        self.alignment = _alignment(self.metadata, self.path)
        self.data_offset = -parser.pos // self.alignment * -self.alignment  # rounded up
        self.tensors = [_tensor_info(raw, self.data_offset, self.path) for raw in raw_tensors]
        _check_tensors(self.tensors, len(self._bytes), self.path)

    def release_pages(self) -> None:
        """Drops the file's pages from this process's resident set (the mapping is read-only: a page touched again
        is read again from the page cache or the file), after a load that read every tensor once."""
        mapping = getattr(self._bytes.base, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def tensor_data(self, info: TensorInfo) -> np.ndarray:
        """A read-only view of the tensor's data, as `gguf.GGUFReader` gives it and `dequantize` takes it.

        Float and integer types come typed and shaped `info.shape`; quantised ones (BF16 included) as uint8,
        shaped `info.shape` with the last dimension replaced by its bytes per row.
        """
        raw = self._bytes[info.offset:info.offset + info.n_bytes]
        dtype = ELEMENT_DTYPES.get(info.ggml_type)
        if dtype is not None:
            return raw.view(dtype).reshape(info.shape)
        return raw.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, info.ggml_type))


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.dequantize`, bit for bit, but always a new writable float32 array (never a view)."""
    fast = FAST_DEQUANTIZERS.get(ggml_type)
    if fast is None:
        return np.array(gguf.quants.dequantize(data, ggml_type), dtype=np.float32)
    element = ELEMENT_DTYPES.get(ggml_type)
    if element is not None:
        return fast(data.view(element))
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    values = fast(blocks)
    return values.reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)


def _map_file(path: Path) -> np.ndarray:
    try:
        # A plain ndarray view (not np.memmap) keeps slicing cheap; its base keeps the mapping alive.
        return np.asarray(np.memmap(path, mode="r"))
    except (OSError, ValueError) as exc:  # numpy refuses to map an empty file with ValueError
        raise ModelLoadError(f"{path} could not be read as a GGUF file ({exc})") from exc


class _Parser:
    """Reads GGUF's header sequentially from `pos`; numbers are little-endian."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.size, self.pos, self.path = buffer, len(buffer), 0, path

    def truncated(self) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is truncated or corrupt after byte {self.pos}; "
                              "expected a complete GGUF file")

    def preamble(self) -> tuple[int, int, int]:
        magic = bytes(self.buffer[:4])
        if magic != MAGIC:
            raise ModelLoadError(f"{self.path} starts with {magic!r}, not a GGUF file; expected the magic {MAGIC!r}")
        self.pos = 4
        version = self.u32()
        if version not in SUPPORTED_VERSIONS:
            endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ModelLoadError(f"{self.path} is GGUF version {version}{endian}; expected little-endian "
                                 f"version {' or '.join(map(str, SUPPORTED_VERSIONS))}")
        return version, self.u64(), self.u64()

    def u32(self) -> int:
        (value,) = U32.unpack_from(self.buffer, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = U64.unpack_from(self.buffer, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        end = self.pos + 8 + self.u64()
        self.require(end)
        text = str(self.buffer[self.pos:end], "utf-8", "replace")
        self.pos = end
        return text

    def require(self, end: int) -> None:
        if end > self.size:
            raise self.truncated()

    def metadata(self, count: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for _ in range(count):
            key = self.string()
            if key in metadata:
                raise ModelLoadError(f"{self.path} repeats metadata key {key!r}; expected each key once")
            metadata[key] = self.value(self.value_type())
        return metadata

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelLoadError(f"{self.path} has metadata value type {raw} at byte {self.pos - 4}; expected "
                                 f"a GGUF value type (0-{max(GGUFValueType)})") from None

    def value(self, kind: GGUFValueType) -> Any:
        if kind == V.STRING:
            return self.string()
        if kind == V.ARRAY:
            return self.array(self.value_type(), self.u64())
        parse = SCALAR_STRUCTS[kind]
        (value,) = parse.unpack_from(self.buffer, self.pos)
        self.pos += parse.size
        return value

    def array(self, kind: GGUFValueType, count: int) -> list[Any]:
        if kind == V.STRING:
            return self.strings(count)
        if kind == V.ARRAY:
            self.require(self.pos + 12 * count)  # each element's own type and length, at least
            return [self.array(self.value_type(), self.u64()) for _ in range(count)]
        dtype = NUMERIC_DTYPES[kind]
        end = self.pos + dtype.itemsize * count
        self.require(end)
        values = np.frombuffer(self.buffer, dtype, count, self.pos).tolist()
        self.pos = end
        return values

    def strings(self, count: int) -> list[str]:
        self.require(self.pos + 8 * count)
        buffer, pos, unpack = self.buffer, self.pos, U64.unpack_from
        strings: list[str] = []
        append = strings.append
        for _ in range(count):  # the hot loop: vocabularies and merges hold ~50k strings each
            start = pos + 8
            pos = start + unpack(buffer, pos)[0]
            append(str(buffer[start:pos], "utf-8", "replace"))
        self.pos = pos
        self.require(pos)  # a slice past the end is silently short; any earlier overrun failed in unpack
        return strings

    def tensor_infos(self, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        """(name, dimensions in GGUF's innermost-first order, raw ggml type, offset in the data section)."""
        infos = []
        for _ in range(count):
            name, n_dims = self.string(), self.u32()
            self.require(self.pos + 8 * n_dims)
            dims = tuple(np.frombuffer(self.buffer, "<u8", n_dims, self.pos).tolist())
            self.pos += 8 * n_dims
            infos.append((name, dims, self.u32(), self.u64()))
        return infos


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    alignment = metadata.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path} has {ALIGNMENT_KEY} = {alignment!r}; expected a power of two")
    return alignment


def _tensor_info(raw: tuple[str, tuple[int, ...], int, int], data_offset: int, path: Path) -> TensorInfo:
    name, dims, raw_type, offset = raw
    try:
        ggml_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {name} has ggml type {raw_type}; expected a known ggml type") from None
    shape = dims[::-1]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if shape and shape[-1] % block_size:
        raise ModelLoadError(f"{path}: tensor {name} has rows of {shape[-1]} values; expected a multiple of "
                             f"{ggml_type.name}'s block size {block_size}")
    return TensorInfo(name, shape, ggml_type, data_offset + offset, prod(shape) // block_size * type_size)


def _check_tensors(tensors: list[TensorInfo], file_size: int, path: Path) -> None:
    names: set[str] = set()
    for info in tensors:
        if info.name in names:
            raise ModelLoadError(f"{path} repeats tensor {info.name}; expected each tensor once")
        names.add(info.name)
        if info.offset + info.n_bytes > file_size:
            raise ModelLoadError(f"{path} is truncated: tensor {info.name} ends at byte "
                                 f"{info.offset + info.n_bytes} of {file_size}; expected a complete GGUF file")


def _as_float32(data: np.ndarray) -> np.ndarray:
    return np.array(data, dtype=np.float32)


def _bf16(data: np.ndarray) -> np.ndarray:
    return np.left_shift(data.view("<u2").astype(np.uint32), 16).view(np.float32)


Decoder = Callable[[np.ndarray, np.ndarray], None]  # (blocks, their float32 values to fill)


def _blockwise(block_values: int) -> Callable[[Decoder], Callable[[np.ndarray], np.ndarray]]:
    """Applies `decode(blocks, values)` chunk by chunk, so that its several passes over the values stay in cache."""
    chunk_blocks = CHUNK_VALUES // block_values

    def wrap(decode: Decoder) -> Callable[[np.ndarray], np.ndarray]:
        def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
            values = np.empty((blocks.shape[0], block_values), dtype=np.float32)
            for start in range(0, blocks.shape[0], chunk_blocks):
                decode(blocks[start:start + chunk_blocks], values[start:start + chunk_blocks])
            return values
        return dequantize_blocks
    return wrap


def _block_scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start:start + 2].view("<f2").astype(np.float32)


def _spread(factors: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each block's factors (one per equal run of its values) repeated over their runs, shaped as `values`:
    numpy broadcasts a column over short rows slowly, and full rows quickly."""
    return factors.repeat(values.shape[1] // factors.shape[1], axis=1)


def _nibbles(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 16 bytes at `start` of each block as 32 uint8 values: the low nibbles, then the high ones. Done a
    uint64 column at a time, since numpy's loops over rows of a few bytes are slow."""
    words = blocks[:, start:start + 16].view("<u8")
    q = np.empty((blocks.shape[0], 4), dtype="<u8")
    for w in range(2):
        np.bitwise_and(words[:, w], LOW_NIBBLES, out=q[:, w])
        np.right_shift(words[:, w], 4, out=q[:, 2 + w])
        q[:, 2 + w] &= LOW_NIBBLES
    return q.view(np.uint8)


def _unpack_nibbles(packed: np.ndarray, q: np.ndarray, groups: int) -> None:
    """Each of `groups` runs of bytes gives its low nibbles, then its high ones, to consecutive uint8 values."""
    packed = packed.reshape(packed.shape[0], groups, -1)
    halves = q.reshape(packed.shape[0], groups, 2, -1)
    np.bitwise_and(packed, 0x0F, out=halves[:, :, 0])
    np.right_shift(packed, 4, out=halves[:, :, 1])


def _crumbs(packed: np.ndarray, groups: int) -> np.ndarray:
    """Each of `groups` runs of bytes as four planes of 2-bit fields, at shifts 0, 2, 4 and 6: uint8
    (n, groups, 4, run). Shifting plane by plane into place beats one broadcast shift."""
    packed = packed.reshape(packed.shape[0], groups, -1)
    planes = np.empty((packed.shape[0], groups, 4, packed.shape[2]), dtype=np.uint8)
    for plane in range(4):
        np.right_shift(packed, 2 * plane, out=planes[:, :, plane])
    planes &= 3
    return planes


def _bit_planes(packed: np.ndarray, weight: int) -> np.ndarray:
    """Bit j of byte b, as 0 or `weight` (uint8), at [:, j, b]: (n, 8, bytes), plane j belonging to sub-block j
    of a K-quant. (Multiplying, as numpy's uint8 left shift is not vectorised.)"""
    planes = np.empty((packed.shape[0], 8, packed.shape[1]), dtype=np.uint8)
    for bit in range(8):
        np.right_shift(packed, bit, out=planes[:, bit])
    planes &= 1
    planes *= weight
    return planes


def _five_bits(blocks: np.ndarray, high: int, low: int) -> np.ndarray:
    """Q5_0/Q5_1 quants as uint8: a little-endian uint32 at `high` holds value i's bit 4 in bit i, and 16 bytes
    at `low` its low nibbles (values 0-15 in the low nibbles, 16-31 in the high ones)."""
    q = _nibbles(blocks, low)
    q |= np.unpackbits(blocks[:, high:high + 4], axis=1, bitorder="little") * np.uint8(16)
    return q


def _signed(q: np.ndarray, offset: int) -> np.ndarray:
    """`q - offset` as int8, in place (uint8 arithmetic wraps to the two's complement)."""
    q -= np.uint8(offset)
    return q.view(np.int8)


def _words(packed: np.ndarray, start: int) -> np.ndarray:
    """The 4 bytes at `start` of each block as a little-endian uint32 column, to unpack four 6-bit fields at once."""
    return packed[:, start:start + 4].view("<u4")


def k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes as eight 6-bit scales and eight 6-bit minimums (uint8). Bytes 0-3 hold scales 0-3
    in their low 6 bits, bytes 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of scale 4+i (low nibble) and
    minimum 4+i (high nibble), whose top 2 bits are the top 2 bits of bytes i and 4+i."""
    low, mins, high = (_words(packed, at) for at in (0, 4, 8))
    scales, minimums = np.empty((2, packed.shape[0], 2), dtype="<u4")
    scales[:, :1], minimums[:, :1] = low & 0x3F3F3F3F, mins & 0x3F3F3F3F
    scales[:, 1:] = (high & 0x0F0F0F0F) | ((low >> 2) & 0x30303030)
    minimums[:, 1:] = ((high >> 4) & 0x0F0F0F0F) | ((mins >> 2) & 0x30303030)
    return scales.view(np.uint8), minimums.view(np.uint8)


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes as sixteen signed 6-bit scales (int8): the low 4 bits of scale i in byte i % 8 (low nibble
    for i < 8, high for the rest), its top 2 bits at shift 2 * (i // 4) of byte 8 + i % 4; stored plus 32."""
    low, high = (_words(packed, 0), _words(packed, 4)), _words(packed, 8)
    scales = np.empty((packed.shape[0], 4), dtype="<u4")
    for four in range(4):  # scales 4 * four .. 4 * four + 3
        nibbles = (low[four % 2] >> (4 * (four // 2))) & 0x0F0F0F0F
        scales[:, four:four + 1] = nibbles | (((high >> (2 * four)) & 0x03030303) << 4)
    return _signed(scales.view(np.uint8), 32)


@_blockwise(BLOCK_VALUES)
def _q8_0(blocks: np.ndarray, values: np.ndarray) -> None:
    values[:] = blocks[:, 2:].view(np.int8)
    values *= _spread(_block_scale(blocks, 0), values)


@_blockwise(BLOCK_VALUES)
def _q4_0(blocks: np.ndarray, values: np.ndarray) -> None:
    # d (f16), 16 bytes of nibbles (values 0-15 low, 16-31 high); the value is d * (q - 8)
    values[:] = _signed(_nibbles(blocks, 2), 8)
    values *= _spread(_block_scale(blocks, 0), values)


@_blockwise(BLOCK_VALUES)
def _q4_1(blocks: np.ndarray, values: np.ndarray) -> None:
    # d and m (f16), 16 bytes of nibbles; gguf computes d * q + m in float32, in that order, unfused
    values[:] = _nibbles(blocks, 4)
    values *= _spread(_block_scale(blocks, 0), values)
    values += _spread(_block_scale(blocks, 2), values)


@_blockwise(BLOCK_VALUES)
def _q5_0(blocks: np.ndarray, values: np.ndarray) -> None:
    # d (f16), the high bits (4 bytes), the low nibbles (16 bytes); the value is d * (q - 16)
    values[:] = _signed(_five_bits(blocks, 2, 6), 16)
    values *= _spread(_block_scale(blocks, 0), values)


@_blockwise(BLOCK_VALUES)
def _q5_1(blocks: np.ndarray, values: np.ndarray) -> None:
    # d and m (f16), the high bits (4 bytes), the low nibbles (16 bytes); the value is d * q + m, unfused
    values[:] = _five_bits(blocks, 4, 8)
    values *= _spread(_block_scale(blocks, 0), values)
    values += _spread(_block_scale(blocks, 2), values)


@_blockwise(QK_K)
def _q2_k(blocks: np.ndarray, values: np.ndarray) -> None:
    # 16 bytes of 4-bit scale (low) and min (high) per 16 values, 64 bytes of 2-bit quants (two runs of 32
    # bytes, each four 32-value planes), d and dmin (f16); value = (d * scale) * q - dmin * min, in float32
    values[:] = _crumbs(blocks[:, 16:80], 2).reshape(values.shape)
    scales = blocks[:, :16]
    values *= _spread(_block_scale(blocks, 80) * (scales & 0x0F), values)
    values -= _spread(_block_scale(blocks, 82) * (scales >> 4), values)


@_blockwise(QK_K)
def _q3_k(blocks: np.ndarray, values: np.ndarray) -> None:
    # 32 bytes of high bits (eight 32-value planes), 64 bytes of 2-bit quants laid out as Q2_K's, 12 bytes of
    # scales, d (f16); the quant is low | high << 2, less 4, and the value (d * scale) * quant
    q = _crumbs(blocks[:, 32:96], 2).reshape(values.shape)
    q |= _bit_planes(blocks[:, :32], 4).reshape(values.shape)
    values[:] = _signed(q, 4)
    values *= _spread(_block_scale(blocks, 108) * _q3_k_scales(blocks[:, 96:108]), values)


@_blockwise(QK_K)
def _q4_k(blocks: np.ndarray, values: np.ndarray) -> None:
    # d and dmin (f16), 12 bytes of 6-bit scales and mins per 32 values, 128 bytes of nibbles (four runs of 32
    # bytes, low nibbles then high); value = (d * scale) * q - dmin * min, in float32
    q = np.empty(values.shape, dtype=np.uint8)
    _unpack_nibbles(blocks[:, 16:], q, groups=4)
    values[:] = q
    _scale_and_shift_k(blocks, values)


def _scale_and_shift_k(blocks: np.ndarray, values: np.ndarray) -> None:
    """Q4_K and Q5_K: value = (d * scale) * q - dmin * min, with d and dmin the block's first two f16s."""
    scales, minimums = k_scales_mins(blocks[:, 4:16])
    values *= _spread(_block_scale(blocks, 0) * scales, values)
    values -= _spread(_block_scale(blocks, 2) * minimums, values)


@_blockwise(QK_K)
def _q5_k(blocks: np.ndarray, values: np.ndarray) -> None:
    # as Q4_K, with 32 bytes of fifth bits (eight 32-value planes) before the nibbles
    q = np.empty(values.shape, dtype=np.uint8)
    _unpack_nibbles(blocks[:, 48:], q, groups=4)
    q |= _bit_planes(blocks[:, 16:48], 16).reshape(values.shape)
    values[:] = q
    _scale_and_shift_k(blocks, values)


@_blockwise(QK_K)
def _q6_k(blocks: np.ndarray, values: np.ndarray) -> None:
    # 128 bytes of low nibbles (two runs of 64 bytes, one per 128 values, low nibbles then high), 64 bytes of
    # top 2 bits (two runs of 32 bytes, four planes each), 16 int8 scales, d (f16); value = (d * scale) * (q - 32)
    q = np.empty(values.shape, dtype=np.uint8)
    _unpack_nibbles(blocks[:, :128], q, groups=2)
    high = _crumbs(blocks[:, 128:192], 2)
    high *= np.uint8(16)
    q |= high.reshape(values.shape)
    values[:] = _signed(q, 32)
    values *= _spread(_block_scale(blocks, 208) * blocks[:, 192:208].view(np.int8), values)


FAST_DEQUANTIZERS: MappingProxyType[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = MappingProxyType({
    T.F32: _as_float32, T.F16: _as_float32, T.BF16: _bf16, T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1,
    T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
})
