"""Numba kernels: quantised KV pages (FP8 E4M3 and FP4 E2M1), for the CPU (njit) and the GPU (cuda.jit).

A KV page is [block_size, kv_heads, head_dim] of one layer's keys or values, in bf16 or fp32; the host API
takes a batch of pages [P, bs, H, D]. Scales travel beside the codes so a page is self-contained.

FP8 E4M3 (OCP "fn" variant)
    Bits S.EEEE.MMM, exponent bias 7, no infinities, largest finite +-448 (0x7E / 0xFE), NaN = S.1111.111
    (0x7F / 0xFF), subnormals down to 2**-9 (exponent field 0: value = M * 2**-9).
    Scale: one float32 per (page, kv-head): scale = pow2_ceil(amax / 448), amax = max |x| over that head's
    [block_size, head_dim] slice of the page, finite values only (NaN and +-inf are left out); pow2_ceil
    rounds up to a power of two, at least 2**-126. When amax / 448 is 0 (an all-zero slice, or amax below
    448 * 2**-149) the scale is 1. Why powers of two: dividing by one is exact, so the scaled values keep
    E4M3's full precision (its relative step is the same in every binade; the largest lands in (224, 448]),
    and a page re-quantised under a grown scale keeps its codes up to an exact shift instead of being
    rounded a second time (engine/kv/formats.py).
    Encode: code = e4m3(x / scale), division in float32, round to nearest even on the bit pattern;
    |x / scale| >= 448 (incl. inf) saturates to +-448; NaN -> 0x7F / 0xFF keeping the input's sign;
    -0 -> 0x80. Decode: e4m3 -> float32, times scale in float32, then to the output dtype (bf16 by round to
    nearest even). Decoded NaNs are canonical (fp32 0x7FC00000, bf16 0x7FC0), whatever their sign.
    Scalar round trip: all 256 codes decode and re-encode to themselves, NaN sign and -0 included
    (e4m3_to_f32 returns 0x7FC00000 / 0xFFC00000 for 0x7F / 0xFF, as ml_dtypes does).

FP4 E2M1 (NVFP4-style two-level scaling)
    Bits S.EE.M, exponent bias 1: values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no NaN, no inf.
    Packing: two codes per byte along head_dim, element 2i in the low nibble, 2i+1 in the high nibble.
    Page scale: one float32 per page: page_scale = pow2_ceil(amax_page / (6 * 448)) with amax_page over the
    whole [block_size, kv_heads, head_dim] page, finite values only; 1 when amax_page / (6 * 448) is 0.
    Block scale: one E4M3 code per 16 consecutive values along head_dim:
    block = e4m3(amax_16 / (6 * page_scale)) (float32 ops in that order, e4m3 rounding as above).
    Encode: code = e2m1(x / (e4m3_value(block) * page_scale)), round to nearest even, saturating at +-6
    (incl. inf). NaN -> +0 (code 0): E2M1 has no NaN and a zero keeps attention finite. When the block
    scale rounds to 0 (the group's amax is below about 2**-10 * 6 * page_scale) the whole group is +0.
    Decode: e2m1 * (e4m3_value(block) * page_scale) in float32, then to the output dtype.
    Sizes: packed [P, bs, H, D/2] uint8, block_scales [P, bs, H, D/16] uint8, page_scales [P] float32;
    head_dim must be a multiple of 16.

Layout of the code: kv_quant_src holds the plain-Python scalar conversions, per-element/per-group logic
and CPU drivers; targets compiles them with njit and cuda.jit(device=True); cuda_drivers holds the CUDA
kernels and launchers; kv_quant is the torch-facing API. Importing this package compiles nothing and does
not need a GPU or the CUDA toolkit.
"""
from engine.kernels.kv_quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from engine.kernels.targets import build_cpu_kernels, build_cuda_kernels, cpu_kernels, cuda_kernels

__all__ = ["quantize_fp8", "dequantize_fp8", "quantize_fp4", "dequantize_fp4",
           "cpu_kernels", "cuda_kernels", "build_cpu_kernels", "build_cuda_kernels"]
