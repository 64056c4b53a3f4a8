"""CUDA kernels and their launchers for the KV quantisers.

The kernels only map a thread index to the work item and call the per-element / per-group functions of
kv_quant_src (compiled with cuda.jit(device=True) by targets.build_cuda_kernels, which rebinds the names
used here). The launchers take any array numba.cuda accepts (device arrays, objects exposing
__cuda_array_interface__, or NumPy arrays under the simulator) and a stream; all outputs and scratch are
preallocated by the caller, so under torch everything is allocated by torch's caching allocator.

Work split: the amax reduction runs as one thread per row of head_dim values (into a scratch
[P, bs, H] int64 array of amax bits), then one thread per (page, head) or per page folds the rows into the
scales; encoding and decoding run one thread per element (fp8) or per group of 16 values (fp4).
"""
from __future__ import annotations

import types
from typing import Any

import numpy as np
from numba import cuda

from engine.kernels.kv_quant_src import (FP4_GROUP, fp4_decode_group, fp4_encode_group, fp4_page_scale,
                                         fp8_decode, fp8_encode, fp8_scale, max_int, row_amax_bits)

THREADS_PER_BLOCK = 128


def row_amax_kernel(x, shift, row_amax):
    """x [P, bs, H, D] raw bits -> row_amax [P, bs, H] int64 amax bits; one thread per row."""
    i = cuda.grid(1)
    num_pages, block_size, heads, _ = x.shape
    if i < num_pages * block_size * heads:
        p = i // (block_size * heads)
        t = (i // heads) % block_size
        h = i % heads
        row_amax[p, t, h] = row_amax_bits(x, p, t, h, shift)


def fp8_scale_kernel(row_amax, scales):
    """row_amax [P, bs, H] -> scales [P, H] float32; one thread per (page, head)."""
    i = cuda.grid(1)
    num_pages, block_size, heads = row_amax.shape
    if i < num_pages * heads:
        p = i // heads
        h = i % heads
        amax = np.int64(0)
        for t in range(block_size):
            amax = max_int(amax, row_amax[p, t, h])
        scales[p, h] = fp8_scale(amax)


def fp8_encode_kernel(x, shift, scales, codes):
    """x [P, bs, H, D] raw bits, scales [P, H] -> codes [P, bs, H, D] uint8; one thread per element."""
    i = cuda.grid(1)
    num_pages, block_size, heads, dim = x.shape
    if i < num_pages * block_size * heads * dim:
        p = i // (block_size * heads * dim)
        t = (i // (heads * dim)) % block_size
        h = (i // dim) % heads
        d = i % dim
        codes[p, t, h, d] = fp8_encode(x[p, t, h, d], shift, scales[p, h])


def fp8_decode_kernel(codes, scales, out_shift, out):
    """codes [P, bs, H, D] uint8, scales [P, H] -> out [P, bs, H, D] raw bits; one thread per element."""
    i = cuda.grid(1)
    num_pages, block_size, heads, dim = codes.shape
    if i < num_pages * block_size * heads * dim:
        p = i // (block_size * heads * dim)
        t = (i // (heads * dim)) % block_size
        h = (i // dim) % heads
        d = i % dim
        out[p, t, h, d] = fp8_decode(codes[p, t, h, d], scales[p, h], out_shift)


def fp4_page_scale_kernel(row_amax, page_scales):
    """row_amax [P, bs, H] -> page_scales [P] float32; one thread per page."""
    p = cuda.grid(1)
    num_pages, block_size, heads = row_amax.shape
    if p < num_pages:
        amax = np.int64(0)
        for t in range(block_size):
            for h in range(heads):
                amax = max_int(amax, row_amax[p, t, h])
        page_scales[p] = fp4_page_scale(amax)


def fp4_encode_kernel(x, shift, page_scales, packed, block_scales):
    """x [P, bs, H, D] -> packed [P, bs, H, D/2], block_scales [P, bs, H, D/16]; one thread per group."""
    i = cuda.grid(1)
    num_pages, block_size, heads, groups = block_scales.shape
    if i < num_pages * block_size * heads * groups:
        p = i // (block_size * heads * groups)
        t = (i // (heads * groups)) % block_size
        h = (i // groups) % heads
        g = i % groups
        fp4_encode_group(x, packed, block_scales, p, t, h, g, shift, page_scales[p])


def fp4_decode_kernel(packed, block_scales, page_scales, out_shift, out):
    """packed [P, bs, H, D/2], block_scales [P, bs, H, D/16], page_scales [P] -> out [P, bs, H, D]."""
    i = cuda.grid(1)
    num_pages, block_size, heads, groups = block_scales.shape
    if i < num_pages * block_size * heads * groups:
        p = i // (block_size * heads * groups)
        t = (i // (heads * groups)) % block_size
        h = (i // groups) % heads
        g = i % groups
        fp4_decode_group(packed, block_scales, out, p, t, h, g, page_scales[p], out_shift)


KERNELS = (row_amax_kernel, fp8_scale_kernel, fp8_encode_kernel, fp8_decode_kernel, fp4_page_scale_kernel,
           fp4_encode_kernel, fp4_decode_kernel)


def _launch(kernel: Any, work_items: int, stream: Any, *args: Any) -> None:
    if work_items > 0:
        blocks = (work_items + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
        kernel[blocks, THREADS_PER_BLOCK, stream](*args)


def fp8_quantize(k: types.SimpleNamespace, x: Any, shift: int, codes: Any, scales: Any, row_amax: Any,
                 stream: Any = 0) -> None:
    """x [P, bs, H, D] raw bits -> codes, scales [P, H]; row_amax [P, bs, H] int64 is scratch."""
    num_pages, block_size, heads, dim = x.shape
    _launch(k.row_amax_kernel, num_pages * block_size * heads, stream, x, shift, row_amax)
    _launch(k.fp8_scale_kernel, num_pages * heads, stream, row_amax, scales)
    _launch(k.fp8_encode_kernel, num_pages * block_size * heads * dim, stream, x, shift, scales, codes)


def fp8_dequantize(k: types.SimpleNamespace, codes: Any, scales: Any, out_shift: int, out: Any,
                   stream: Any = 0) -> None:
    _launch(k.fp8_decode_kernel, int(np.prod(codes.shape)), stream, codes, scales, out_shift, out)


def fp4_quantize(k: types.SimpleNamespace, x: Any, shift: int, packed: Any, block_scales: Any,
                 page_scales: Any, row_amax: Any, stream: Any = 0) -> None:
    num_pages, block_size, heads, dim = x.shape
    _launch(k.row_amax_kernel, num_pages * block_size * heads, stream, x, shift, row_amax)
    _launch(k.fp4_page_scale_kernel, num_pages, stream, row_amax, page_scales)
    _launch(k.fp4_encode_kernel, num_pages * block_size * heads * (dim // FP4_GROUP), stream,
            x, shift, page_scales, packed, block_scales)


def fp4_dequantize(k: types.SimpleNamespace, packed: Any, block_scales: Any, page_scales: Any,
                   out_shift: int, out: Any, stream: Any = 0) -> None:
    _launch(k.fp4_decode_kernel, int(np.prod(block_scales.shape)), stream,
            packed, block_scales, page_scales, out_shift, out)
