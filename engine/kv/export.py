"""Export a decode actor's KV pool once so that prefill actors can write into it in place.

CPU: the pool lives in a file under /dev/shm mapped MAP_SHARED by every process (`torch.from_file`); peers
receive only its path. GPU: the pool's CUDA IPC handle travels as bytes and peers rebuild a tensor on the
same memory. Either way, per request only block ids move between processes.
"""
from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}


@dataclass
class SharedPool:
    """A tensor backed by memory that other processes can map; `export` is what they need to map it."""

    tensor: torch.Tensor
    export: dict[str, Any]

    def unlink(self) -> None:
        release_export(self.export)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def create_shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu",
                       tag: str = "kv") -> SharedPool:
    if device.startswith("cuda"):
        return _create_cuda_pool(shape, dtype, device)
    path = _shm_dir() / f"phase-serve-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tensor = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    os.chmod(path, 0o600)
    return SharedPool(tensor, {"kind": "shm", "name": str(path), "shape": list(shape),
                               "dtype": _dtype_name(dtype)})


def open_shared_pool(export: dict[str, Any]) -> torch.Tensor:
    """Map a pool another process exported; writes through the returned tensor land in that pool."""
    shape, dtype = tuple(export["shape"]), DTYPES[export["dtype"]]
    if export["kind"] == "cuda_ipc":
        return _open_cuda_pool(export, shape, dtype)
    if export["kind"] != "shm":
        raise ValueError(f"cannot map a KV pool exported as {export['kind']!r}")
    path = Path(export["name"])
    if not path.is_file() or path.stat().st_size != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"shared KV pool {path} is missing or has the wrong size")
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


def release_export(export: dict[str, Any]) -> None:
    """Remove the backing file (mappings that exist stay valid until they are dropped)."""
    if export.get("kind") == "shm":
        Path(export["name"]).unlink(missing_ok=True)


def _shm_dir() -> Path:
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path("/tmp")


def _create_cuda_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> SharedPool:
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    storage = tensor.untyped_storage()
    handle = storage._share_cuda_()  # (device, handle, size, offset, ref_handle, ref_offset, event, sync)
    export = {"kind": "cuda_ipc", "shape": list(shape), "dtype": _dtype_name(dtype),
              "ipc": [_to_wire(x) for x in handle]}
    return SharedPool(tensor, export)


def _open_cuda_pool(export: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device, handle, size, offset, ref_handle, ref_offset, event, sync = export["ipc"]
    return rebuild_cuda_tensor(torch.Tensor, shape, _contiguous_strides(shape), 0, torch.storage.TypedStorage, dtype,
                               device, handle, size, offset, False, ref_handle, ref_offset, event, sync)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def _to_wire(value: Any) -> Any:
    return value if isinstance(value, (int, float, bytes, str, bool)) or value is None else bytes(value)
