"""Export a decode actor's KV pool once so that prefill actors can write into it in place.

CPU: the pool is a /dev/shm file that is unlinked the moment it is created: only open descriptors and mappings
keep it, so the kernel frees it when the last process holding it ends, however it ends (a clean stop, SIGTERM
to the whole group, SIGKILL). Its space is allocated up front, so a /dev/shm too small for it fails at start
with a sentence saying so, never with a SIGBUS mid-request. Peers get the descriptor over a Unix socket
(transport.fd_passing) that the pool's owner serves for as long as it lives, so a prefill actor restarted
later still maps it. GPU: the pool's CUDA IPC handle travels as bytes and peers rebuild a tensor on the same
memory. Either way, per request only block ids move between processes.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from transport.fd_passing import FdServer, receive_fd
from transport.owned import owned_prefix, reclaim

SHM_DIR = Path("/dev/shm")
POOL_KIND = "kv"  # the owned-name kind of pool files (transport.owned)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
MIB = 1 << 20


class SharedMemoryError(RuntimeError):
    """The shared-memory file system cannot hold a KV pool."""


@dataclass
class SharedPool:
    """A tensor backed by memory that other processes can map; `export` is what they need to map it."""

    tensor: torch.Tensor
    export: dict[str, Any]
    fd: int | None = None  # the (unlinked) pool file on CPU
    server: FdServer | None = None

    def serve(self, socket_path: str | os.PathLike[str]) -> None:
        """Offer the pool to other processes: they get its descriptor from a socket at `socket_path`."""
        if self.fd is not None and self.server is None:
            self.server = FdServer(socket_path, self.fd)
            self.export["socket"] = str(socket_path)

    def close(self) -> None:
        """Stop offering the pool; the memory itself lives on until the last mapping of it is dropped."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def create_shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu",
                       tag: str = "kv", assume_free: int | None = None) -> SharedPool:
    """`assume_free`: bytes the shared-memory file system is taken to have free instead of what it reports
    (EngineConfig.shm_free_bytes)."""
    if device.startswith("cuda"):
        return _create_cuda_pool(shape, dtype, device)
    size = math.prod(shape) * dtype.itemsize
    directory = shm_dir()
    free = shm_free_bytes(directory) if assume_free is None else assume_free
    if free < size:
        raise SharedMemoryError(_too_small(directory, free, size))
    path = directory / f"{owned_prefix(POOL_KIND)}{tag}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        path.unlink()
        _allocate(fd, size, directory, assume_free)
        tensor = _map(fd, shape, dtype)
    except BaseException:
        os.close(fd)
        raise
    export = {"kind": "shm", "pid": os.getpid(), "fd": fd, "shape": list(shape), "dtype": _dtype_name(dtype)}
    return SharedPool(tensor, export, fd)


def open_shared_pool(export: dict[str, Any]) -> torch.Tensor:
    """Map a pool another process exported; writes through the returned tensor land in that pool."""
    shape, dtype = tuple(export["shape"]), DTYPES[export["dtype"]]
    if export["kind"] == "cuda_ipc":
        return _open_cuda_pool(export, shape, dtype)
    if export["kind"] != "shm":
        raise ValueError(f"cannot map a KV pool exported as {export['kind']!r}")
    fd = _descriptor(export)
    try:
        if os.fstat(fd).st_size != math.prod(shape) * dtype.itemsize:
            raise ValueError("the shared KV pool has the wrong size")
        return _map(fd, shape, dtype)
    finally:
        os.close(fd)


def shm_free_bytes(directory: Path = SHM_DIR) -> int:
    """Bytes that `directory` can still allocate."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def reclaim_stale_pools() -> list[Path]:
    """Remove pool files whose owner died before it could unlink them (transport.owned decides which)."""
    return reclaim(shm_dir(), POOL_KIND)


def _too_small(directory: Path, free: int, size: int) -> str:
    return (f"{directory} has {free / MIB:.0f} MiB free but a decode actor's KV hand-off pool needs "
            f"{math.ceil(size / MIB)} MiB: give the container more shared memory (docker run "
            f"--shm-size={math.ceil(size * 1.25 / MIB)}m per decode actor, or --ipc=host), or shrink the pool "
            f"with --kv-cache-memory or --num-kv-blocks")


def _allocate(fd: int, size: int, directory: Path, assume_free: int | None) -> None:
    """Reserve every page now: a file system that runs out later would raise SIGBUS on a write to the pool."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            free = shm_free_bytes(directory) if assume_free is None else assume_free
            raise SharedMemoryError(_too_small(directory, free, size)) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: sized, pages come on first touch


def _map(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor on a MAP_SHARED mapping of the file (the mapping outlives `fd`; the tensor keeps it alive)."""
    mapping = mmap.mmap(fd, math.prod(shape) * dtype.itemsize, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)


def _descriptor(export: dict[str, Any]) -> int:
    """A descriptor of the pool file for this process to map (and close)."""
    if export.get("pid") == os.getpid() and export.get("fd") is not None:
        return os.dup(export["fd"])
    if not export.get("socket"):
        raise ValueError("this shared KV pool is not offered to other processes")
    return receive_fd(export["socket"])


def shm_dir() -> Path:
    """/dev/shm where this process may write there, else /tmp."""
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
