"""Tests for engine.kernels: FP8 E4M3 / FP4 E2M1 scalar conversions and KV page quantisers.

References: ml_dtypes for the scalar formats (float8_e4m3fn, float4_e2m1fn), torch for bf16 rounding, and
a NumPy re-implementation of the page formats (written from the spec in engine/kernels/__init__.py, not
from the kernels) for bit-exact page-level checks. The CUDA kernels run under the CUDA simulator in a
subprocess (tests/kv_quant_cudasim_check.py) and are compiled to real PTX where libNVVM is installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import pytest
import torch

from engine.kernels import (build_cuda_kernels, cpu_kernels, dequantize_fp4, dequantize_fp8, quantize_fp4,
                            quantize_fp8)
from tests.kv_quant_cudasim_check import cpu_map, make_pages, scalar_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
E4M3 = ml_dtypes.float8_e4m3fn
E2M1 = ml_dtypes.float4_e2m1fn
F32 = np.float32


def u32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------------------
# NumPy / ml_dtypes references
# ---------------------------------------------------------------------------------------------------------

def ref_e4m3(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' E4M3 codes under the kernels' saturation. ml_dtypes rounds to nearest even but turns
    anything that rounds past 448 (and inf) into NaN, while the kernels saturate to +-448. Clipping to
    [-448, 448] first leaves every |x| <= 448 unchanged and sends everything larger (which saturation
    maps to +-448) exactly to +-448, so for non-NaN x the reference is ml_dtypes(clip(x)); NaN inputs go to
    ml_dtypes unclipped (0x7F / 0xFF by sign)."""
    x = np.asarray(x, np.float32)
    clipped = np.where(np.isnan(x), x, np.clip(x, F32(-448), F32(448)))
    with np.errstate(invalid="ignore"):  # NumPy warns about casting NaN
        return clipped.astype(E4M3).view(np.uint8)


def ref_e2m1(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' E2M1 codes (it saturates at +-6 like the kernels); NaN -> 0 is the kernels' policy."""
    x = np.asarray(x, np.float32)
    codes = np.where(np.isnan(x), F32(0), x).astype(E2M1).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0), codes).astype(np.uint8)


def finite_abs(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), np.abs(x), F32(0)).astype(np.float32)


def ref_pow2_ceil(q: np.ndarray) -> np.ndarray:
    """The smallest power of two >= q, at least 2**-126, for q > 0; 0 stays 0 (by frexp, not bit tricks)."""
    mantissa, exponent = np.frexp(q.astype(np.float64))  # q = mantissa * 2**exponent, mantissa in [0.5, 1)
    up = np.where(mantissa == 0.5, q, np.ldexp(1.0, exponent))
    with np.errstate(over="ignore"):  # above 2**127: inf, as the kernel (scales never get there)
        return np.where(q == 0, 0, np.maximum(up, 2.0 ** -126)).astype(np.float32)


def ref_quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [P, bs, H, D] float32 -> (codes [P, bs, H, D], scales [P, H])."""
    scales = ref_pow2_ceil((finite_abs(x).max(axis=(1, 3)) / F32(448)).astype(np.float32))  # [P, H]
    scales[scales == 0] = 1
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.where(np.isnan(x), x, x / scales[:, None, :, None])
    return ref_e4m3(q), scales


def ref_quantize_fp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [P, bs, H, D] float32 -> (packed [P, bs, H, D/2], block_scales [P, bs, H, D/16], page_scales [P])."""
    num_pages, block_size, heads, dim = x.shape
    page_scales = ref_pow2_ceil((finite_abs(x).max(axis=(1, 2, 3)) / F32(2688)).astype(np.float32))  # [P]
    page_scales[page_scales == 0] = 1
    groups = x.reshape(num_pages, block_size, heads, dim // 16, 16)
    ps = page_scales[:, None, None, None]
    block_scales = ref_e4m3(finite_abs(groups).max(axis=-1) / (F32(6) * ps))  # [P, bs, H, D/16]
    divisor = (block_scales.view(E4M3).astype(np.float32) * ps)[..., None]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        codes = ref_e2m1(groups / divisor)
    codes = np.where(divisor == 0, np.uint8(0), codes).reshape(x.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), block_scales, page_scales


def to_dtype_bits(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 -> the bits the kernels write: torch's round to nearest even, NaN canonical."""
    nan = np.isnan(v)
    if dtype == torch.bfloat16:
        bits = torch.from_numpy(np.where(nan, F32(0), v)).to(torch.bfloat16).view(torch.int16).numpy()
        return np.where(nan, np.int16(0x7FC0), bits)
    return np.where(nan, np.uint32(0x7FC00000), u32(v)).view(np.int32)


def ref_dequantize_fp8(codes: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return to_dtype_bits(codes.view(E4M3).astype(np.float32) * scales[:, None, :, None], dtype)


def ref_dequantize_fp4(packed: np.ndarray, block_scales: np.ndarray, page_scales: np.ndarray,
                       dtype: torch.dtype) -> np.ndarray:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)  # [P, bs, H, D]
    mult = block_scales.view(E4M3).astype(np.float32) * page_scales[:, None, None, None]  # [P, bs, H, D/16]
    values = codes.view(E2M1).astype(np.float32) * np.repeat(mult, 16, axis=-1)
    return to_dtype_bits(values, dtype)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy()


def pages(dtype: torch.dtype, seed: int = 0, shape: tuple[int, int, int, int] = (5, 16, 3, 64)
          ) -> tuple[torch.Tensor, np.ndarray]:
    """Test pages in `dtype` and their exact float32 values."""
    x = torch.from_numpy(make_pages(np.random.default_rng(seed), shape)).to(dtype)
    return x, x.float().numpy()


# ---------------------------------------------------------------------------------------------------------
# Import and build without a GPU
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.process
def test_import_needs_no_gpu_and_compiles_nothing():
    code = ("import sys, engine.kernels as k; assert 'numba.cuda' not in sys.modules; "
            "ns = k.build_cuda_kernels(); print(type(ns.fp8_encode_kernel).__name__)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "CUDADispatcher" in done.stdout


# ---------------------------------------------------------------------------------------------------------
# Scalar conversions (njit) against ml_dtypes / torch
# ---------------------------------------------------------------------------------------------------------

def test_all_256_e4m3_codes_decode_like_ml_dtypes_and_reencode_to_themselves():
    codes = np.arange(256, dtype=np.uint8)
    values = cpu_map(cpu_kernels(), "e4m3_to_f32")(codes)
    want = codes.view(E4M3).astype(np.float32)
    assert np.array_equal(u32(values), u32(want))  # NaN codes too: 0x7FC00000 / 0xFFC00000
    assert np.isnan(values[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(values, [0x7F, 0xFF])).all()
    assert values[0x7E] == 448 and values[0x01] == 2.0 ** -9 and u32(values[[0x80]])[0] == 0x80000000
    # No exceptions: -0 (0x80) and both NaN codes re-encode to themselves because the sign is kept.
    assert np.array_equal(cpu_map(cpu_kernels(), "f32_to_e4m3")(values), codes)


def test_all_16_e2m1_codes_decode_like_ml_dtypes_and_reencode_to_themselves():
    codes = np.arange(16, dtype=np.uint8)
    values = cpu_map(cpu_kernels(), "e2m1_to_f32")(codes)
    assert np.array_equal(u32(values), u32(codes.view(E2M1).astype(np.float32)))
    assert list(values[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert np.array_equal(cpu_map(cpu_kernels(), "f32_to_e2m1")(values), codes)


@pytest.fixture(scope="module")
def scalar_f32() -> np.ndarray:
    """Edge cases (zeros, f32 and E4M3 subnormals, every tie of both grids and its neighbours, saturation,
    inf, NaNs with payloads) plus 200k random values (log-uniform magnitudes and raw bit patterns)."""
    return scalar_inputs(np.random.default_rng(1), 200_000)


def test_f32_to_e4m3_is_bit_identical_to_ml_dtypes(scalar_f32):
    got = cpu_map(cpu_kernels(), "f32_to_e4m3")(scalar_f32)
    want = ref_e4m3(scalar_f32)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(u32(scalar_f32[i:i + 1])[0]), hex(got[i]), hex(want[i])) for i in bad[:10]]


def test_scales_round_up_to_powers_of_two(scalar_f32):
    x = np.abs(scalar_f32[np.isfinite(scalar_f32)])  # amax / 448 is finite and >= 0
    got = cpu_map(cpu_kernels(), "pow2_ceil")(x)
    assert np.array_equal(u32(got), u32(ref_pow2_ceil(x)))
    edge = np.array([0.0, 1e-45, 2.0 ** -126, 1.0, 1.5, 2.0 ** 100 * 1.0001], np.float32)
    assert cpu_map(cpu_kernels(), "pow2_ceil")(edge).tolist() == [0.0, 2.0 ** -126, 2.0 ** -126, 1.0, 2.0, 2.0 ** 101]


def test_e4m3_rounding_edge_cases():
    enc = cpu_map(cpu_kernels(), "f32_to_e4m3")
    x = np.array([2.0 ** -10, 1.5 * 2 ** -10, 2.5 * 2 ** -9, 3.5 * 2 ** -9, 1e-45, 464, 465, 1e38, np.inf,
                  -np.inf, np.nan, -np.nan, -0.0], np.float32)
    # ties to even in the subnormal range (0, 2, 4), the smallest f32 subnormal to 0, saturation, NaN sign
    assert list(enc(x)) == [0x00, 0x01, 0x02, 0x04, 0x00, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0xFF, 0x80]


def test_f32_to_e2m1_is_bit_identical_to_ml_dtypes_and_maps_nan_to_zero(scalar_f32):
    got = cpu_map(cpu_kernels(), "f32_to_e2m1")(scalar_f32)
    want = ref_e2m1(scalar_f32)
    assert np.array_equal(got, want)
    assert (got[np.isnan(scalar_f32)] == 0).all()
    enc = cpu_map(cpu_kernels(), "f32_to_e2m1")
    assert list(enc(np.array([0.25, 0.75, 1.25, 2.5, 3.5, 5, 7, np.inf, -np.inf, -0.0], np.float32))) == \
        [0x0, 0x2, 0x2, 0x4, 0x6, 0x6, 0x7, 0x7, 0xF, 0x8]


def test_bf16_conversions_match_torch(scalar_f32):
    got = cpu_map(cpu_kernels(), "f32_to_bf16_bits")(scalar_f32)
    nan = np.isnan(scalar_f32)
    torch_bits = torch.from_numpy(scalar_f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got[~nan], torch_bits[~nan].astype(np.int64))
    assert (got[nan] == 0x7FC0).all()
    b16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    widened = cpu_map(cpu_kernels(), "bf16_bits_to_f32")(b16)
    want = torch.from_numpy(b16.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(u32(widened), u32(want))


# ---------------------------------------------------------------------------------------------------------
# Pages: bit-exact against the NumPy reference, error bounds, special pages
# ---------------------------------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_fp8_pages_match_reference_bit_for_bit(dtype):
    x, x32 = pages(dtype)
    codes, scales = quantize_fp8(x)
    want_codes, want_scales = ref_quantize_fp8(x32)
    assert np.array_equal(u32(scales.numpy()), u32(want_scales))
    assert np.array_equal(codes.numpy(), want_codes)
    for out_dtype in DTYPES:
        y = dequantize_fp8(codes, scales, out_dtype)
        assert y.dtype == out_dtype and y.shape == x.shape
        assert np.array_equal(bits(y), ref_dequantize_fp8(want_codes, want_scales, out_dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_fp4_pages_match_reference_bit_for_bit(dtype):
    x, x32 = pages(dtype)
    packed, block_scales, page_scales = quantize_fp4(x)
    want = ref_quantize_fp4(x32)
    assert np.array_equal(u32(page_scales.numpy()), u32(want[2]))
    assert np.array_equal(block_scales.numpy(), want[1])
    assert np.array_equal(packed.numpy(), want[0])
    for out_dtype in DTYPES:
        y = dequantize_fp4(packed, block_scales, page_scales, out_dtype)
        assert y.dtype == out_dtype and y.shape == x.shape
        assert np.array_equal(bits(y), ref_dequantize_fp4(*want, out_dtype))


def out_rounding(dtype: torch.dtype) -> float:
    """Relative error of the final cast to the output dtype."""
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_fp8_error_bounds(dtype):
    """Per element: |err| <= 2**-4 |x| (half an E4M3 step in the normal range) + 2**-10 * scale (half the
    subnormal step) + the output cast; so per (page, head) the worst error is below 1/16 of its amax."""
    x, x32 = pages(dtype, seed=3, shape=(16, 16, 3, 64))
    codes, scales = quantize_fp8(x)
    y = dequantize_fp8(codes, scales, dtype).float().numpy()
    s = scales.numpy()[:, None, :, None]
    finite = np.isfinite(x32)
    err = np.abs(y - x32)
    bound = (2.0 ** -4 + out_rounding(dtype)) * np.abs(x32) + 2.0 ** -10 * s
    assert (err[finite] <= bound[finite]).all()
    amax = finite_abs(x32).max(axis=(1, 3))[:, None, :, None]
    rel = np.where(finite, err, 0) / np.where(amax > 0, amax, 1)
    assert rel.max() < 1 / 16 + 2 ** -8
    assert np.sqrt((rel[:3] ** 2).mean()) < 0.02  # Gaussian pages: typical error far below the worst case


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_fp4_error_bounds(dtype):
    """Per 16-value group with amax a and page scale s: |err| <= 0.178 a + 6 s 2**-10 + the output cast.
    (At most one E2M1 unit, unit = block * s <= (a / 6)(1 + 2**-4) + s 2**-10; saturation after the block
    scale rounded down costs at most a 2**-4 + 6 s 2**-10.)"""
    x, x32 = pages(dtype, seed=4, shape=(16, 16, 3, 64))
    packed, block_scales, page_scales = quantize_fp4(x)
    y = dequantize_fp4(packed, block_scales, page_scales, dtype).float().numpy()
    finite = np.isfinite(x32)
    group_amax = np.repeat(finite_abs(x32.reshape(16, 16, 3, 4, 16)).max(-1), 16, axis=-1)  # [P, bs, H, D]
    ps = page_scales.numpy()[:, None, None, None]
    err = np.abs(y - x32)
    bound = 0.178 * group_amax + 6 * ps * 2.0 ** -10 + out_rounding(dtype) * np.abs(x32)
    assert (err[finite] <= bound[finite]).all()
    page_amax = finite_abs(x32).max(axis=(1, 2, 3))[:, None, None, None]
    rel = np.where(finite, err, 0) / np.where(page_amax > 0, page_amax, 1)
    assert rel.max() < 0.18
    assert np.sqrt((rel[:1] ** 2).mean()) < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_zero_pages_round_trip_exactly(dtype):
    x = torch.zeros(2, 16, 3, 64, dtype=dtype)
    codes, scales = quantize_fp8(x)
    assert (codes == 0).all() and (scales == 1).all()
    assert torch.equal(dequantize_fp8(codes, scales, dtype), x)
    packed, block_scales, page_scales = quantize_fp4(x)
    assert (packed == 0).all() and (block_scales == 0).all() and (page_scales == 1).all()
    assert torch.equal(dequantize_fp4(packed, block_scales, page_scales, dtype), x)


def test_outlier_only_coarsens_its_own_head_and_its_own_group():
    x = torch.randn(1, 16, 3, 64, generator=torch.Generator().manual_seed(5))
    x[0, 3, 1, 7] = 5000.0
    codes, scales = quantize_fp8(x)
    y8 = dequantize_fp8(codes, scales, torch.float32)
    assert scales[0, 1] == 16.0 and scales[0, 0] < 0.02 and scales[0, 2] < 0.02  # 5000 / 448 = 11.2, rounded up
    assert abs(y8[0, 3, 1, 7].item() - 5000) <= 5000 / 16
    quiet = [0, 2]  # heads without the outlier keep their full precision
    assert ((y8[..., quiet, :] - x[..., quiet, :]).abs() <= x[..., quiet, :].abs() / 16 + 1e-4).all()

    packed, block_scales, page_scales = quantize_fp4(x)
    y4 = dequantize_fp4(packed, block_scales, page_scales, torch.float32)
    assert abs(y4[0, 3, 1, 7].item() - 5000) <= 0.178 * 5000
    # Two-level scaling: groups away from the outlier still get a block scale fitted to their own amax.
    groups = x.reshape(1, 16, 3, 4, 16)
    err = (y4 - x).abs().reshape(1, 16, 3, 4, 16)
    away = torch.ones(1, 16, 3, 4, dtype=torch.bool)
    away[0, 3, 1, 0] = False
    group_amax = groups.abs().amax(-1)
    assert (err.amax(-1)[away] <= 0.178 * group_amax[away] + 6 * page_scales[0] * 2 ** -10).all()


def test_nan_and_inf_do_not_poison_the_scales():
    x = torch.randn(1, 16, 2, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x.view(torch.int16)[0, 0, 0, :2] = torch.tensor([0x7FC0, 0xFFC0 - 0x10000], dtype=torch.int16)  # +-NaN
    x[0, 0, 0, 2] = float("inf")
    x[0, 0, 0, 3] = float("-inf")
    amax = x.float()[0, :, 0][x.float()[0, :, 0].isfinite()].abs().max()
    codes, scales = quantize_fp8(x)
    assert scales[0, 0].item() == ref_pow2_ceil(np.float32(amax.item() / 448))
    assert codes[0, 0, 0, :4].tolist() == [0x7F, 0xFF, 0x7E, 0xFE]
    y = dequantize_fp8(codes, scales, torch.bfloat16)
    assert y.view(torch.int16)[0, 0, 0, :2].tolist() == [0x7FC0, 0x7FC0]  # canonical NaN
    assert y[0, 0, 0, 2].item() == pytest.approx(448 * scales[0, 0].item(), rel=2 ** -8)
    packed, block_scales, page_scales = quantize_fp4(x)
    assert page_scales[0].item() == ref_pow2_ceil(np.float32(x.float()[x.float().isfinite()].abs().max().item() / 2688))
    assert packed[0, 0, 0, 0].item() == 0x00  # NaN, NaN -> +0, +0
    assert packed[0, 0, 0, 1].item() == 0xF7  # +inf, -inf saturate to +-6 (codes 0x7 and 0xF)
    y4 = dequantize_fp4(packed, block_scales, page_scales, torch.float32)
    assert y4[0, 0, 0, :2].tolist() == [0.0, 0.0] and y4[0, 0, 0, 2] == -y4[0, 0, 0, 3] > 0


def test_fp4_nibble_order_low_nibble_holds_the_even_element():
    x = torch.zeros(1, 1, 1, 16)
    x[0, 0, 0, 0], x[0, 0, 0, 1] = 6.0, -1.0  # codes 0x7 and 0xA at page amax 6
    packed, block_scales, page_scales = quantize_fp4(x)
    assert packed[0, 0, 0, 0].item() == 0xA7
    y = dequantize_fp4(packed, block_scales, page_scales, torch.float32)
    assert y[0, 0, 0, :2].tolist() == [6.0, -1.0]


def test_out_buffers_non_contiguous_input_and_empty_batches():
    x, _ = pages(torch.bfloat16, seed=7, shape=(4, 16, 3, 64))
    pool_codes = torch.zeros(8, 16, 3, 64, dtype=torch.uint8)
    pool_scales = torch.zeros(8, 3)
    codes, scales = quantize_fp8(x, out=(pool_codes[2:6], pool_scales[2:6]))
    assert codes.data_ptr() == pool_codes[2].data_ptr()
    assert torch.equal(pool_codes[2:6], quantize_fp8(x)[0]) and (pool_codes[:2] == 0).all()
    y = torch.empty(4, 16, 3, 64, dtype=torch.bfloat16)
    assert dequantize_fp8(codes, scales, out=y) is y
    # a page travels as its codes and scales; decoding it alone equals decoding it in the batch
    alone = dequantize_fp8(codes[1:2].clone(), scales[1:2].clone())
    assert torch.equal(alone.view(torch.int16), y[1:2].view(torch.int16))

    transposed = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    assert torch.equal(quantize_fp4(transposed)[0], quantize_fp4(x)[0])

    threads = numba.get_num_threads()
    quantize_fp8(x[:1])  # small calls run on one thread, then restore the caller's setting
    assert numba.get_num_threads() == threads

    empty = torch.zeros(0, 16, 3, 64, dtype=torch.bfloat16)
    assert quantize_fp8(empty)[0].shape == (0, 16, 3, 64)
    assert dequantize_fp4(*quantize_fp4(empty)).shape == (0, 16, 3, 64)


def test_bad_arguments_are_rejected():
    with pytest.raises(TypeError):
        quantize_fp8(torch.zeros(1, 2, 3, 4, dtype=torch.float16))
    with pytest.raises(ValueError):
        quantize_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        quantize_fp4(torch.zeros(1, 2, 3, 24))
    with pytest.raises(ValueError):
        wrong_scales = (torch.zeros(1, 2, 3, 4, dtype=torch.uint8), torch.zeros(3))
        quantize_fp8(torch.zeros(1, 2, 3, 4), out=wrong_scales)
    codes, scales = quantize_fp8(torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError):
        dequantize_fp8(codes, scales[:, :2])


# ---------------------------------------------------------------------------------------------------------
# CUDA: real PTX where libNVVM exists, the CUDA simulator in a subprocess
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvvm() -> None:
    """libNVVM (the CUDA toolkit's compiler), looked for by the test that needs it rather than at collection."""
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
    except Exception as exc:
        pytest.skip(f"libNVVM (CUDA toolkit) not installed: {exc!r}")


@pytest.mark.usefixtures("nvvm")
def test_cuda_kernels_compile_to_ptx_for_sm90(monkeypatch):
    """The simulator runs the kernels as Python and type-checks nothing; this compiles them for the real
    CUDA target (no GPU needed, only libNVVM) and checks that float division is IEEE (div.rn.f32, no ftz)."""
    import numba.cuda.dispatcher
    from numba import cuda
    from numba import types as nt

    class Sm90:  # device functions are compiled for "the current device", which this machine lacks
        compute_capability = (9, 0)

    monkeypatch.setattr(numba.cuda.dispatcher, "get_current_device", lambda: Sm90())
    k = build_cuda_kernels()

    def arr(dtype: nt.Type, ndim: int) -> nt.Array:
        return nt.Array(dtype, ndim, "C")

    amax, page = arr(nt.int64, 3), arr(nt.uint8, 4)
    signatures = {
        "row_amax_kernel": (arr(nt.int16, 4), nt.int64, amax),
        "fp8_scale_kernel": (amax, arr(nt.float32, 2)),
        "fp8_encode_kernel": (arr(nt.int32, 4), nt.int64, arr(nt.float32, 2), page),
        "fp8_decode_kernel": (page, arr(nt.float32, 2), nt.int64, arr(nt.int16, 4)),
        "fp4_page_scale_kernel": (amax, arr(nt.float32, 1)),
        "fp4_encode_kernel": (arr(nt.int16, 4), nt.int64, arr(nt.float32, 1), page, page),
        "fp4_decode_kernel": (page, page, arr(nt.float32, 1), nt.int64, arr(nt.int32, 4)),
    }
    for name, signature in signatures.items():
        ptx, _ = cuda.compile_ptx(getattr(k, name).py_func, signature, cc=(9, 0))
        assert ".entry" in ptx and ".ftz" not in ptx, name
        if name == "fp8_encode_kernel":
            assert "div.rn.f32" in ptx


@pytest.mark.timeout(360)
@pytest.mark.process
def test_cuda_kernels_under_simulator_match_njit():
    """tests/kv_quant_cudasim_check.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 (the switch must be set
    before numba is imported): every scalar helper, the page kernels and the torch API's CUDA branch, CUDA
    vs njit, bit for bit. About 15 s when the njit cache is warm (the tests above warm it), 40 s cold."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "kv_quant_cudasim_check.py")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "0 mismatches" in done.stdout
