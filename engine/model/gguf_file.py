"""A fast, pure-Python reader for GGUF files (llama.cpp's format), versions 2 and 3, little-endian only.

`GGUFFile(path)` parses the header, every metadata key/value and every tensor info up front, which takes a
under 0.1 s for a 50k-token vocabulary and 50k merges (`gguf.GGUFReader` takes seconds), and memory-maps the
file once; `tensor_data` returns read-only views into that map.

Metadata values are plain Python objects: int, float, bool or str, and every array, whatever its size, a
list of those (a list of lists for arrays of arrays). Strings are UTF-8 with invalid bytes replaced.

`dequantize` turns tensor data into float32, bit-identical to `gguf.quants.dequantize`, with vectorised
paths for F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (gguf's own splits every tensor into 16-row groups).
"""
from __future__ import annotations

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
BLOCK_VALUES = 32  # values per block of Q8_0, Q4_0 and Q4_1
CHUNK_BLOCKS = 8192
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


def _blockwise(decode: Callable[[np.ndarray, np.ndarray], None]) -> Callable[[np.ndarray], np.ndarray]:
    """Applies `decode(blocks, values)` chunk by chunk, so that its several passes over the values stay in cache."""
    def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
        values = np.empty((blocks.shape[0], BLOCK_VALUES), dtype=np.float32)
        for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
            decode(blocks[start:start + CHUNK_BLOCKS], values[start:start + CHUNK_BLOCKS])
        return values
    return dequantize_blocks


def _block_scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of each block, as a float32 column."""
    return blocks[:, start:start + 2].view("<f2").astype(np.float32)


def _unpack_nibbles(packed: np.ndarray, values: np.ndarray) -> None:
    """Each block's low nibbles, then its high ones, as floats (casting is faster than a table lookup)."""
    halves = values.reshape(packed.shape[0], 2, -1)
    halves[:, 0] = packed & 0x0F
    halves[:, 1] = packed >> 4


@_blockwise
def _q8_0(blocks: np.ndarray, values: np.ndarray) -> None:
    values[:] = blocks[:, 2:].view(np.int8)
    values *= _block_scale(blocks, 0)


@_blockwise
def _q4_0(blocks: np.ndarray, values: np.ndarray) -> None:
    _unpack_nibbles(blocks[:, 2:], values)
    values -= 8  # exact: gguf subtracts 8 in int8 before converting
    values *= _block_scale(blocks, 0)


@_blockwise
def _q4_1(blocks: np.ndarray, values: np.ndarray) -> None:
    _unpack_nibbles(blocks[:, 4:], values)
    values *= _block_scale(blocks, 0)  # gguf computes d * q + m in float32, in that order, unfused
    values += _block_scale(blocks, 2)


FAST_DEQUANTIZERS: MappingProxyType[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = MappingProxyType({
    T.F32: _as_float32, T.F16: _as_float32, T.BF16: _bf16, T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1,
})
