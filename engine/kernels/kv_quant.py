"""Host API of the KV page quantisers (formats: see engine/kernels/__init__.py).

CPU tensors go to the njit kernels through zero-copy NumPy views; CUDA tensors go to the CUDA kernels
through __cuda_array_interface__, launched on torch's current stream of the tensor's device. bf16 travels
as its int16 bit pattern (numba has no bf16), fp32 as int32.
"""
from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, Iterator

import numba
import torch

from engine.kernels.kv_quant_src import FP4_GROUP
from engine.kernels.targets import cpu_kernels, cuda_kernels

_BITS_VIEW = MappingProxyType({torch.bfloat16: (torch.int16, 16), torch.float32: (torch.int32, 0)})
# Calls on fewer elements run on one thread: waking numba's thread team costs several microseconds, more
# than it saves on a few pages, and far more when another process holds the other core.
PARALLEL_MIN_ELEMENTS = 1 << 15


@contextlib.contextmanager
def _cpu_threads(num_elements: int) -> Iterator[None]:
    """numba's threads for one call: one for a small call, else numba's own count. numba's OpenMP layer, when it
    starts its team, sets the calling thread's OpenMP team size, which is torch's too (and the C++ kernels'):
    an engine given one core would then run two threads on it. Torch's count is put back after every call."""
    torch_threads = torch.get_num_threads()
    try:
        if num_elements >= PARALLEL_MIN_ELEMENTS or numba.get_num_threads() == 1:
            yield
            return
        previous = numba.get_num_threads()
        numba.set_num_threads(1)  # thread-local in numba: other threads' settings are untouched
        try:
            yield
        finally:
            numba.set_num_threads(previous)
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def _as_bits(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous integer view of a bf16 / fp32 tensor and the shift that widens it to float32 bits."""
    if x.dtype not in _BITS_VIEW:
        raise TypeError(f"KV pages must be bfloat16 or float32, got {x.dtype}")
    int_dtype, shift = _BITS_VIEW[x.dtype]
    return x.detach().contiguous().view(int_dtype), shift


def _check_pages(x: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    if x.dim() != 4:
        raise ValueError(f"{what} must be [num_pages, block_size, kv_heads, head_dim], got {tuple(x.shape)}")
    return tuple(x.shape)  # type: ignore[return-value]


def _check_tensor(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  name: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
    return t


def _out_or_new(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return _check_tensor(out, shape, dtype, device, name)


def _uses_cuda(t: torch.Tensor) -> bool:
    """Whether `t` goes to the CUDA kernels (a seam for the simulator check, which has no CUDA tensors)."""
    return t.is_cuda


def _cuda_launch(launcher: Any, device: torch.device, *args: Any) -> None:
    """Run a cuda_drivers launcher on torch's current stream of `device`; tensors among `args` are passed
    as CUDA arrays through __cuda_array_interface__ (no copy), other arguments as they are."""
    from numba import cuda

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cuda.gpus[index]:
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        # sync=False: the kernels run on the stream torch queued the producers on, so order is kept.
        arrays = [cuda.as_cuda_array(a, sync=False) if isinstance(a, torch.Tensor) else a for a in args]
        launcher(cuda_kernels(), *arrays, stream=stream)


# ---------------------------------------------------------------------------------------------------------
# FP8 E4M3, one float32 scale per (page, kv-head)
# ---------------------------------------------------------------------------------------------------------

def quantize_fp8(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [P, bs, H, D] bf16/fp32 -> (codes [P, bs, H, D] uint8 E4M3, scales [P, H] float32)."""
    num_pages, block_size, heads, dim = _check_pages(x, "x")
    raw, shift = _as_bits(x)
    codes = _out_or_new(out[0] if out else None, tuple(x.shape), torch.uint8, x.device, "codes")
    scales = _out_or_new(out[1] if out else None, (num_pages, heads), torch.float32, x.device, "scales")
    if x.numel() == 0:
        return codes, scales
    if _uses_cuda(x):
        from engine.kernels import cuda_drivers

        row_amax = torch.empty((num_pages, block_size, heads), dtype=torch.int64, device=x.device)
        _cuda_launch(cuda_drivers.fp8_quantize, x.device, raw, shift, codes, scales, row_amax)
    else:
        with _cpu_threads(x.numel()):
            cpu_kernels().fp8_quantize_pages(raw.numpy(), shift, codes.numpy(), scales.numpy())
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [P, bs, H, D] uint8, scales [P, H] float32 -> [P, bs, H, D] in `dtype` (bf16 or fp32)."""
    num_pages, _, heads, _ = _check_pages(codes, "codes")
    _check_tensor(codes, tuple(codes.shape), torch.uint8, codes.device, "codes")
    _check_tensor(scales, (num_pages, heads), torch.float32, codes.device, "scales")
    result = _out_or_new(out, tuple(codes.shape), dtype, codes.device, "out")
    raw, out_shift = _as_bits(result)
    if codes.numel() == 0:
        return result
    if _uses_cuda(codes):
        from engine.kernels import cuda_drivers

        _cuda_launch(cuda_drivers.fp8_dequantize, codes.device, codes, scales, out_shift, raw)
    else:
        with _cpu_threads(codes.numel()):
            cpu_kernels().fp8_dequantize_pages(codes.numpy(), scales.numpy(), out_shift, raw.numpy())
    return result


# ---------------------------------------------------------------------------------------------------------
# FP4 E2M1, an E4M3 scale per 16 values along head_dim and a float32 scale per page
# ---------------------------------------------------------------------------------------------------------

def quantize_fp4(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [P, bs, H, D] bf16/fp32, D % 16 == 0 -> (packed [P, bs, H, D/2] uint8,
    block_scales [P, bs, H, D/16] uint8 E4M3, page_scales [P] float32)."""
    num_pages, block_size, heads, dim = _check_pages(x, "x")
    if dim % FP4_GROUP:
        raise ValueError(f"head_dim must be a multiple of {FP4_GROUP} for fp4, got {dim}")
    raw, shift = _as_bits(x)
    packed = _out_or_new(out[0] if out else None, (num_pages, block_size, heads, dim // 2), torch.uint8,
                         x.device, "packed")
    block_scales = _out_or_new(out[1] if out else None, (num_pages, block_size, heads, dim // FP4_GROUP),
                               torch.uint8, x.device, "block_scales")
    page_scales = _out_or_new(out[2] if out else None, (num_pages,), torch.float32, x.device, "page_scales")
    if x.numel() == 0:
        return packed, block_scales, page_scales
    if _uses_cuda(x):
        from engine.kernels import cuda_drivers

        row_amax = torch.empty((num_pages, block_size, heads), dtype=torch.int64, device=x.device)
        _cuda_launch(cuda_drivers.fp4_quantize, x.device, raw, shift, packed, block_scales, page_scales,
                     row_amax)
    else:
        with _cpu_threads(x.numel()):
            cpu_kernels().fp4_quantize_pages(raw.numpy(), shift, packed.numpy(), block_scales.numpy(),
                                             page_scales.numpy())
    return packed, block_scales, page_scales


def dequantize_fp4(packed: torch.Tensor, block_scales: torch.Tensor, page_scales: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """(packed [P, bs, H, D/2], block_scales [P, bs, H, D/16], page_scales [P]) -> [P, bs, H, D] `dtype`."""
    num_pages, block_size, heads, half_dim = _check_pages(packed, "packed")
    dim = half_dim * 2
    device = packed.device
    _check_tensor(packed, tuple(packed.shape), torch.uint8, device, "packed")
    _check_tensor(block_scales, (num_pages, block_size, heads, dim // FP4_GROUP), torch.uint8, device,
               "block_scales")
    _check_tensor(page_scales, (num_pages,), torch.float32, device, "page_scales")
    result = _out_or_new(out, (num_pages, block_size, heads, dim), dtype, device, "out")
    raw, out_shift = _as_bits(result)
    if packed.numel() == 0:
        return result
    if _uses_cuda(packed):
        from engine.kernels import cuda_drivers

        _cuda_launch(cuda_drivers.fp4_dequantize, device, packed, block_scales, page_scales, out_shift, raw)
    else:
        with _cpu_threads(raw.numel()):
            cpu_kernels().fp4_dequantize_pages(packed.numpy(), block_scales.numpy(), page_scales.numpy(),
                                               out_shift, raw.numpy())
    return result


def compile_cpu_kernels() -> None:
    """Compiles the CPU page quantisers for bf16 and fp32 pages, or loads them from numba's cache on disk (beside
    kv_quant_src.py), where the compile leaves them for every later process."""
    for dtype in (torch.bfloat16, torch.float32):
        pages = torch.zeros(1, 1, 1, FP4_GROUP, dtype=dtype)
        dequantize_fp8(*quantize_fp8(pages), dtype)
        dequantize_fp4(*quantize_fp4(pages), dtype)
