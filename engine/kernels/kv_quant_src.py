"""Plain-Python sources of the KV quantisation kernels (formats: see engine/kernels/__init__.py).

Every function here is ordinary Python that runs as is (slowly, on NumPy scalars). `engine.kernels.targets`
compiles each one twice, with `numba.njit` and with `numba.cuda.jit(device=True)`, after rebinding the
names of the functions it calls to their compiled twins. Rules that keep the njit build, the CUDA build and
the CUDA simulator (which runs this very code on NumPy scalars) bit-identical:

- float constants are written `np.float32(...)`: a bare `448.0` is float64 under numba but a "weak" scalar
  under NumPy, so the two would compute in different precisions;
- bit patterns are int64 values in [0, 2**32) reinterpreted with `.view` on np.uint32 / np.float32;
- every rounding into E4M3 / E2M1 / bf16 is integer arithmetic on bit patterns, never a float cast; the
  float32 arithmetic the formats specify (amax / 448, x / scale, value * scale) is plain IEEE float32
  (no fastmath, no flush-to-zero) on both targets;
- NaNs are written as explicit bit patterns: GPU arithmetic replaces a NaN operand by the canonical NaN,
  x86 keeps its sign and payload, so a NaN that went through arithmetic would differ between the builds.

All the jitted sources (scalar helpers, per-element logic, CPU drivers) live in this one file because
numba's on-disk cache only notices edits to the file that holds the function it cached.
"""
from __future__ import annotations

import numpy as np
from numba import prange

F32_ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000
F32_CANONICAL_NAN = 0x7FC00000
F32_SMALLEST_NORMAL_BITS = 0x00800000  # 2**-126, also one unit of the exponent field
BF16_CANONICAL_NAN = 0x7FC0  # positive quiet NaN (torch's vectorised CPU cast writes 0xFFFF instead)
E4M3_MAX_BITS = 0x43E00000  # 448.0
E2M1_MAX_BITS = 0x40C00000  # 6.0
FP4_GROUP = 16  # values per E4M3 block scale, along head_dim


# ---------------------------------------------------------------------------------------------------------
# Scalar conversions
# ---------------------------------------------------------------------------------------------------------

def f32_to_bits(x):
    """float32 -> its IEEE bit pattern as an int64 in [0, 2**32)."""
    return np.int64(np.float32(x).view(np.uint32))


def bits_to_f32(bits):
    """An int64 in [0, 2**32) -> the float32 with that bit pattern."""
    return np.uint32(bits).view(np.float32)


def bf16_bits_to_f32(b16):
    """bfloat16 bits (int16 or uint16) -> float32: bf16 is the upper half of a float32."""
    return bits_to_f32((np.int64(b16) & 0xFFFF) << 16)


def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits in [0, 65536), round to nearest even (as torch and ml_dtypes); every NaN
    becomes 0x7FC0."""
    b = f32_to_bits(x)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry moves into the exponent,
    # which is also how IEEE rounding overflows to infinity.
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.int64(BF16_CANONICAL_NAN) if (b & F32_ABS_MASK) > F32_INF_BITS else rounded


def max_int(a, b):
    """max of two integers (numba.cuda 0.68 fails to type the builtin max(int64, int64))."""
    return a if a > b else b


def clamp_shift(s):
    return 1 if s < 1 else (33 if s > 33 else s)


def rne_shift_right(v, s):
    """v / 2**s rounded to nearest, ties to even, for 0 <= v < 2**32 and any s (clamped to 1..33; every
    v < 2**32 rounds to 0 at s = 33, and the clamp keeps shifts defined in LLVM)."""
    s = clamp_shift(s)
    # v + (half - 1) carries into the kept bits when the remainder exceeds half; the kept lowest bit adds
    # the missing 1 for an exact half when the quotient is odd: ties go to even.
    return (v + ((np.int64(1) << (s - 1)) - 1) + ((v >> s) & 1)) >> s


def round_to_minifloat(a, man_bits, bias):
    """Bits `a` of a finite float32 >= 0 -> the unsigned code (exponent | mantissa) of the nearest value
    (ties to even) of a minifloat with `man_bits` mantissa bits and exponent bias `bias`; subnormals
    included. The caller saturates, so the result is used only below the format's largest value.
    Both candidates are computed and one selected, so the compiled loop has no data-dependent branch."""
    e = a >> 23
    # Normal in the target: the f32 exponent sits right above the kept mantissa bits, so a rounding carry
    # correctly bumps the exponent; then rebias 127 -> bias.
    normal = rne_shift_right(a, 23 - man_bits) - ((127 - bias) << man_bits)
    # Subnormal in the target: count units of 2**(1 - bias - man_bits). f32 subnormals (e == 0) have no
    # implicit bit and the exponent of the smallest normal.
    m = (a & 0x7FFFFF) | (0x800000 if e > 0 else 0)
    subnormal = rne_shift_right(m, 151 - bias - man_bits - (e if e > 0 else 1))
    return normal if e >= 128 - bias else subnormal


def minifloat_to_f32_bits(u, man_bits, bias):
    """Unsigned minifloat code (exponent | mantissa, no sign, not NaN) -> float32 bits."""
    e = u >> man_bits
    m = u & ((1 << man_bits) - 1)
    normal = ((e - bias + 127) << 23) | (m << (23 - man_bits))
    # Subnormal: m * 2**(1 - bias - man_bits). int -> float of m < 2**man_bits and the product with a power
    # of two are exact (no rounding), and the result is a float32 normal, so flush-to-zero can't touch it.
    unit = bits_to_f32((128 - bias - man_bits) << 23)
    subnormal = f32_to_bits(np.float32(m) * unit)
    return subnormal if e == 0 else normal


def f32_to_e4m3(x):
    """float32 -> E4M3 ("fn") code: round to nearest even, |x| >= 448 (and inf) saturate to +-448,
    NaN -> 0x7F with the sign of x, -0 -> 0x80."""
    b = f32_to_bits(x)
    a = b & F32_ABS_MASK
    code = round_to_minifloat(a, 3, 7)
    code = 0x7E if a >= E4M3_MAX_BITS else code
    code = 0x7F if a > F32_INF_BITS else code
    return np.uint8(((b >> 24) & 0x80) | code)


def e4m3_to_f32(code):
    """E4M3 code -> float32; the two NaN codes give quiet NaNs with their sign (0x7FC00000 / 0xFFC00000)."""
    c = np.int64(code) & 0xFF
    magnitude = minifloat_to_f32_bits(c & 0x7F, 3, 7)
    magnitude = F32_CANONICAL_NAN if (c & 0x7F) == 0x7F else magnitude
    return bits_to_f32(((c & 0x80) << 24) | magnitude)


def f32_to_e2m1(x):
    """float32 -> E2M1 code in the low nibble: round to nearest even, |x| >= 6 (and inf) saturate to +-6,
    NaN -> 0 (+0: E2M1 has no NaN, and a zero keeps attention finite), -0 -> 0x8."""
    b = f32_to_bits(x)
    a = b & F32_ABS_MASK
    code = round_to_minifloat(a, 1, 1)
    code = 0x7 if a >= E2M1_MAX_BITS else code
    code = ((b >> 28) & 0x8) | code
    return np.uint8(0 if a > F32_INF_BITS else code)


def e2m1_to_f32(code):
    """E2M1 code (low nibble) -> float32."""
    c = np.int64(code) & 0xF
    return bits_to_f32(((c & 0x8) << 28) | minifloat_to_f32_bits(c & 0x7, 1, 1))


# ---------------------------------------------------------------------------------------------------------
# Per-element / per-row / per-group logic shared by the CPU drivers below and the CUDA kernels
# (engine/kernels/cuda_drivers.py). Inputs are raw bits: bf16 as int16 with shift 16, fp32 as int32 with
# shift 0. Outputs are raw bits too: out_shift 16 writes bf16 into int16, 0 writes fp32 into int32.
# ---------------------------------------------------------------------------------------------------------

def load_f32(raw, shift):
    return bits_to_f32((np.int64(raw) << shift) & 0xFFFFFFFF)


def store_value(y, out_shift):
    """float32 -> the signed integer to store in the int16 (bf16) or int32 (fp32) output; NaN canonical."""
    if out_shift == 16:
        v = f32_to_bf16_bits(y)
        return v - 0x10000 if v >= 0x8000 else v
    b = f32_to_bits(y)
    b = np.int64(F32_CANONICAL_NAN) if (b & F32_ABS_MASK) > F32_INF_BITS else b
    return b - 0x100000000 if b >= 0x80000000 else b


def finite_abs_bits(raw, shift):
    """Bits of |x| for finite x, 0 for NaN and inf (left out of every amax). For x >= 0 the float order
    is the order of the bit patterns, so amax is an integer max."""
    a = (np.int64(raw) << shift) & F32_ABS_MASK
    return a if a < F32_INF_BITS else np.int64(0)


def row_amax_bits(x, p, t, h, shift):
    """Bits of max |x[p, t, h, :]| over finite values, 0 for none."""
    best = np.int64(0)
    for d in range(x.shape[3]):
        best = max_int(best, finite_abs_bits(x[p, t, h, d], shift))
    return best


def pow2_ceil(q):
    """float32 q >= 0 -> the smallest power of two >= q, at least 2**-126 (the smallest normal); 0 -> 0;
    inf above 2**127 (amax / 448 stays below 2**120).
    Scales are powers of two so that re-quantising a page under a grown scale is exact (see kv_formats)."""
    b = f32_to_bits(q)
    exponent = b & F32_INF_BITS
    up = bits_to_f32(F32_SMALLEST_NORMAL_BITS if exponent == 0 else exponent + F32_SMALLEST_NORMAL_BITS)
    return q if (b & 0x7FFFFF) == 0 else up


def fp8_scale(amax_bits):
    """Scale of one (page, kv-head): amax / 448 rounded up to a power of two, or 1 when amax / 448 is 0 (an
    all-zero head, or underflow)."""
    scale = pow2_ceil(bits_to_f32(amax_bits) / np.float32(448.0))
    return np.float32(1.0) if scale == np.float32(0.0) else scale


def fp8_encode(raw, shift, scale):
    x = load_f32(raw, shift)
    q = x / scale
    return f32_to_e4m3(x if x != x else q)  # NaN: keep the input's sign, not a quotient's (see module doc)


def fp8_decode(code, scale, out_shift):
    return store_value(e4m3_to_f32(code) * scale, out_shift)


def fp4_page_scale(amax_bits):
    """Scale of one page: amax / (6 * 448) rounded up to a power of two, or 1 when amax / 2688 is 0."""
    scale = pow2_ceil(bits_to_f32(amax_bits) / np.float32(2688.0))
    return np.float32(1.0) if scale == np.float32(0.0) else scale


def fp4_encode(raw, shift, divisor):
    code = np.int64(f32_to_e2m1(load_f32(raw, shift) / divisor))  # NaN stays NaN, which maps to +0
    # A block scale rounded to 0 (x / 0 is inf or NaN): the group is negligible next to the page amax.
    return np.int64(0) if divisor == np.float32(0.0) else code


def fp4_encode_group(x, packed, block_scales, p, t, h, g, shift, page_scale):
    """Encode x[p, t, h, 16g:16g+16] into packed[p, t, h, 8g:8g+8] and block_scales[p, t, h, g]."""
    d0 = g * FP4_GROUP
    amax = np.int64(0)
    for i in range(FP4_GROUP):
        amax = max_int(amax, finite_abs_bits(x[p, t, h, d0 + i], shift))
    bcode = f32_to_e4m3(bits_to_f32(amax) / (np.float32(6.0) * page_scale))
    block_scales[p, t, h, g] = bcode
    divisor = e4m3_to_f32(bcode) * page_scale
    for i in range(FP4_GROUP // 2):
        lo = fp4_encode(x[p, t, h, d0 + 2 * i], shift, divisor)
        hi = fp4_encode(x[p, t, h, d0 + 2 * i + 1], shift, divisor)
        packed[p, t, h, g * (FP4_GROUP // 2) + i] = lo | (hi << 4)


def fp4_decode_group(packed, block_scales, out, p, t, h, g, page_scale, out_shift):
    """Decode packed[p, t, h, 8g:8g+8] into out[p, t, h, 16g:16g+16]."""
    mult = e4m3_to_f32(block_scales[p, t, h, g]) * page_scale
    d0 = g * FP4_GROUP
    for i in range(FP4_GROUP // 2):
        byte = np.int64(packed[p, t, h, g * (FP4_GROUP // 2) + i])
        out[p, t, h, d0 + 2 * i] = store_value(e2m1_to_f32(byte & 0xF) * mult, out_shift)
        out[p, t, h, d0 + 2 * i + 1] = store_value(e2m1_to_f32(byte >> 4) * mult, out_shift)


# ---------------------------------------------------------------------------------------------------------
# CPU drivers (compiled with njit; prange is range when they run as plain Python)
# ---------------------------------------------------------------------------------------------------------

def fp8_quantize_pages(x, shift, codes, scales):
    """x [P, bs, H, D] raw bits -> codes [P, bs, H, D] uint8, scales [P, H] float32."""
    num_pages, block_size, heads, dim = x.shape
    for ph in prange(num_pages * heads):
        p = ph // heads
        h = ph % heads
        amax = np.int64(0)
        for t in range(block_size):
            amax = max_int(amax, row_amax_bits(x, p, t, h, shift))
        scale = fp8_scale(amax)
        scales[p, h] = scale
        for t in range(block_size):
            for d in range(dim):
                codes[p, t, h, d] = fp8_encode(x[p, t, h, d], shift, scale)


def fp8_dequantize_pages(codes, scales, out_shift, out):
    """codes [P, bs, H, D] uint8, scales [P, H] float32 -> out [P, bs, H, D] raw bits."""
    num_pages, block_size, heads, dim = codes.shape
    for p in prange(num_pages):
        for t in range(block_size):
            for h in range(heads):
                scale = scales[p, h]
                for d in range(dim):
                    out[p, t, h, d] = fp8_decode(codes[p, t, h, d], scale, out_shift)


def fp4_quantize_pages(x, shift, packed, block_scales, page_scales):
    """x [P, bs, H, D] raw bits -> packed [P, bs, H, D/2] uint8, block_scales [P, bs, H, D/16] uint8 (E4M3),
    page_scales [P] float32."""
    num_pages, block_size, heads, dim = x.shape
    for p in prange(num_pages):
        amax = np.int64(0)
        for t in range(block_size):
            for h in range(heads):
                amax = max_int(amax, row_amax_bits(x, p, t, h, shift))
        page_scale = fp4_page_scale(amax)
        page_scales[p] = page_scale
        for t in range(block_size):
            for h in range(heads):
                for g in range(dim // FP4_GROUP):
                    fp4_encode_group(x, packed, block_scales, p, t, h, g, shift, page_scale)


def fp4_dequantize_pages(packed, block_scales, page_scales, out_shift, out):
    """packed [P, bs, H, D/2], block_scales [P, bs, H, D/16], page_scales [P] -> out [P, bs, H, D] bits."""
    num_pages, block_size, heads, groups = block_scales.shape
    for p in prange(num_pages):
        page_scale = page_scales[p]
        for t in range(block_size):
            for h in range(heads):
                for g in range(groups):
                    fp4_decode_group(packed, block_scales, out, p, t, h, g, page_scale, out_shift)


# Dependency order: each function only calls functions listed before it.
DEVICE_FUNCTIONS = (
    f32_to_bits, bits_to_f32, bf16_bits_to_f32, f32_to_bf16_bits, max_int, clamp_shift, rne_shift_right,
    round_to_minifloat, minifloat_to_f32_bits, f32_to_e4m3, e4m3_to_f32, f32_to_e2m1, e2m1_to_f32,
    load_f32, store_value, finite_abs_bits, row_amax_bits, pow2_ceil, fp8_scale, fp8_encode, fp8_decode,
    fp4_page_scale, fp4_encode, fp4_encode_group, fp4_decode_group,
)
CPU_DRIVERS = (fp8_quantize_pages, fp8_dequantize_pages, fp4_quantize_pages, fp4_dequantize_pages)
# Inlined at numba-IR level in the njit build: LLVM leaves these calls out of line, which slows the fp4
# drivers several times (docs/performance.md, "KV page quantisers": python -m bench.kv_quant_throughput).
NJIT_INLINE = frozenset({"row_amax_bits", "fp4_encode", "fp4_encode_group", "fp4_decode_group"})
