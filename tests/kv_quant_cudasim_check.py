"""The CUDA KV quantisers under numba's CUDA simulator, compared bit for bit with their njit twins.

The simulator must be switched on before numba is imported, so tests/test_kv_quant.py runs this file in a
subprocess with NUMBA_ENABLE_CUDASIM=1 (`NUMBA_ENABLE_CUDASIM=1 python tests/kv_quant_cudasim_check.py`
by hand). It is not a pytest module (no test_ prefix); test_kv_quant.py also imports its input builders.
The simulator runs every thread in Python, so the arrays here are small (the whole run takes seconds).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import types
import warnings
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import numpy as np

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels.targets import retarget  # noqa: E402

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

def f32_from_bits(bits: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


def grid_with_ties(values: np.ndarray) -> np.ndarray:
    """Positive grid values, the exact midpoints between neighbours (ties for round-to-nearest-even), and
    the float32 neighbours of each, all with both signs."""
    values = np.unique(values.astype(np.float32))
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)  # exact: few bits
    around = np.concatenate([values, mids])
    out = np.concatenate([around, np.nextafter(around, np.float32(np.inf)),
                          np.nextafter(around, np.float32(0))])
    return np.concatenate([out, -out]).astype(np.float32)


def e4m3_grid() -> np.ndarray:
    import ml_dtypes

    codes = np.arange(0x7F, dtype=np.uint8)  # non-negative finite codes 0 .. 448
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def special_f32() -> np.ndarray:
    """Zeros, float32 subnormals, E4M3 subnormals and ties, both grids' ties, saturation, inf and NaNs."""
    bits = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000,
            0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,  # max finite, inf
            0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA12345]  # NaNs
    edges = np.array([2.0 ** -10, 2.0 ** -9, 1.5 * 2 ** -10, 2.0 ** -6, 2.0 ** -7, 0.25, 0.75, 5.0, 5.5,
                      6.0, 6.5, 7.0, 448.0, 449.0, 463.99, 464.0, 464.01, 480.0, 496.0, 500.0, 1e4, 1e30],
                     np.float32)
    grids = [grid_with_ties(e4m3_grid()), grid_with_ties(E2M1_VALUES), edges, -edges]
    return np.concatenate([f32_from_bits(bits)] + grids).astype(np.float32)


def random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    """Half log-uniform magnitudes over 2**-40 .. 2**40 (both grids' subnormal ranges and saturation),
    half uniformly random bit patterns (NaNs, infs, float32 subnormals, huge values)."""
    half = n // 2
    mags = np.exp2(rng.uniform(-40, 40, half)) * rng.choice([-1, 1], half)
    bits = rng.integers(0, 2 ** 32, n - half, dtype=np.uint64)
    return np.concatenate([mags.astype(np.float32), f32_from_bits(bits)])


def scalar_inputs(rng: np.random.Generator, n_random: int) -> np.ndarray:
    return np.concatenate([special_f32(), random_f32(rng, n_random)])


def make_pages(rng: np.random.Generator, shape: tuple[int, int, int, int]) -> np.ndarray:
    """float32 pages [P, bs, H, D]: page 0 Gaussian, page 1 all zeros, page 2 a Gaussian with one huge
    outlier, NaN, +-inf, subnormals and a group of exact zeros; further pages at mixed scales."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 8, (shape[0], 1, shape[2], 1))).astype(np.float32)
    if shape[0] > 1:
        x[1] = 0
    if shape[0] > 2:
        x[2, 0, 0, 0] = 3e4
        x[2, 0, 0, 1] = np.nan
        x[2, 1, 0, 2] = -np.inf
        x[2, 1, 0, 3] = np.inf
        x[2, 0, 1, 4] = -np.float32(1e-40)
        x[2, -1, -1, :16] = 0
    return x


# ---------------------------------------------------------------------------------------------------------
# Element-wise drivers for the scalar helpers: one template each for the CPU and the GPU, retargeted with
# SCALAR bound to the helper under test.
# ---------------------------------------------------------------------------------------------------------

def _cpu_map(x, out):
    for i in range(x.shape[0]):
        out[i] = SCALAR(x[i])  # noqa: F821 (bound by retarget)


def _gpu_map(x, out):
    i = cuda.grid(1)  # noqa: F821 (bound by retarget)
    if i < x.shape[0]:
        out[i] = SCALAR(x[i])  # noqa: F821


# helper name -> (input dtype, output dtype)
SCALAR_SIGNATURES = {
    "f32_to_e4m3": (np.float32, np.uint8),
    "e4m3_to_f32": (np.uint8, np.float32),
    "f32_to_e2m1": (np.float32, np.uint8),
    "e2m1_to_f32": (np.uint8, np.float32),
    "f32_to_bf16_bits": (np.float32, np.int64),
    "bf16_bits_to_f32": (np.uint16, np.float32),
    "pow2_ceil": (np.float32, np.float32),
}


def cpu_map(kernels: types.SimpleNamespace, name: str) -> Callable[[np.ndarray], np.ndarray]:
    import numba

    loop = retarget([_cpu_map], numba.njit, bound={"SCALAR": getattr(kernels, name)})["_cpu_map"]
    out_dtype = SCALAR_SIGNATURES[name][1]

    def run(x: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape, out_dtype)
        loop(x, out)
        return out
    return run


def gpu_map(kernels: types.SimpleNamespace, name: str) -> Callable[[np.ndarray], np.ndarray]:
    from numba import cuda

    bound = {"SCALAR": getattr(kernels, name), "cuda": cuda}
    kernel = retarget([_gpu_map], cuda.jit, bound=bound)["_gpu_map"]
    out_dtype = SCALAR_SIGNATURES[name][1]

    def run(x: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape, out_dtype)
        kernel[(x.shape[0] + 127) // 128, 128](x, out)
        return out
    return run


def scalar_cases(rng: np.random.Generator, n_random: int) -> dict[str, np.ndarray]:
    """Inputs per helper: float32 edge cases and random values, every E4M3 / E2M1 code, bf16 patterns."""
    f32 = scalar_inputs(rng, n_random)
    bf16_specials = np.array([0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81], np.uint16)
    bf16 = np.concatenate([np.arange(0, 65536, 97, dtype=np.uint16), bf16_specials])
    return {"f32_to_e4m3": f32, "e4m3_to_f32": np.arange(256, dtype=np.uint8), "f32_to_e2m1": f32,
            "e2m1_to_f32": np.arange(16, dtype=np.uint8), "f32_to_bf16_bits": f32, "bf16_bits_to_f32": bf16,
            "pow2_ceil": np.abs(f32[np.isfinite(f32)])}


# ---------------------------------------------------------------------------------------------------------
# Page-level runs of the CPU drivers and of the CUDA launchers on NumPy arrays
# ---------------------------------------------------------------------------------------------------------

def as_bits(x: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """float32 pages -> (raw bits as the kernels take them, shift); bf16 by torch's rounding."""
    import torch

    if dtype == "bf16":
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy(), 16
    return x.view(np.int32), 0


def run_pages(k: types.SimpleNamespace, x_raw: np.ndarray, shift: int, gpu: bool) -> dict[str, np.ndarray]:
    """Quantise with fp8 and fp4, then dequantise both to bf16 and fp32; all results as arrays."""
    from engine.kernels import cuda_drivers

    num_pages, block_size, heads, dim = x_raw.shape
    r = {"codes": np.zeros(x_raw.shape, np.uint8), "scales": np.zeros((num_pages, heads), np.float32),
         "packed": np.zeros((num_pages, block_size, heads, dim // 2), np.uint8),
         "block_scales": np.zeros((num_pages, block_size, heads, dim // 16), np.uint8),
         "page_scales": np.zeros(num_pages, np.float32)}
    outs = {f"{fmt}_{o}": np.zeros(x_raw.shape, np.int16 if o == "bf16" else np.int32)
            for fmt in ("fp8", "fp4") for o in ("bf16", "fp32")}
    if gpu:
        scratch = np.zeros((num_pages, block_size, heads), np.int64)
        cuda_drivers.fp8_quantize(k, x_raw, shift, r["codes"], r["scales"], scratch)
        cuda_drivers.fp4_quantize(k, x_raw, shift, r["packed"], r["block_scales"], r["page_scales"], scratch)
        for o, out_shift in (("bf16", 16), ("fp32", 0)):
            cuda_drivers.fp8_dequantize(k, r["codes"], r["scales"], out_shift, outs[f"fp8_{o}"])
            cuda_drivers.fp4_dequantize(k, r["packed"], r["block_scales"], r["page_scales"], out_shift,
                                        outs[f"fp4_{o}"])
    else:
        k.fp8_quantize_pages(x_raw, shift, r["codes"], r["scales"])
        k.fp4_quantize_pages(x_raw, shift, r["packed"], r["block_scales"], r["page_scales"])
        for o, out_shift in (("bf16", 16), ("fp32", 0)):
            k.fp8_dequantize_pages(r["codes"], r["scales"], out_shift, outs[f"fp8_{o}"])
            k.fp4_dequantize_pages(r["packed"], r["block_scales"], r["page_scales"], out_shift,
                                   outs[f"fp4_{o}"])
    return {**r, **outs}


def host_api_results(x: "torch.Tensor") -> dict[str, np.ndarray]:
    """engine.kernels' torch API on x: fp8 and fp4 round trips to bf16 and fp32, as arrays of bits."""
    import torch

    from engine.kernels import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8

    codes, scales = quantize_fp8(x)
    packed, block_scales, page_scales = quantize_fp4(x)
    r = {"codes": codes, "scales": scales, "packed": packed, "block_scales": block_scales,
         "page_scales": page_scales}
    for dtype, name, int_dtype in ((torch.bfloat16, "bf16", torch.int16),
                                   (torch.float32, "fp32", torch.int32)):
        r[f"fp8_{name}"] = dequantize_fp8(codes, scales, dtype).view(int_dtype)
        r[f"fp4_{name}"] = dequantize_fp4(packed, block_scales, page_scales, dtype).view(int_dtype)
    return {k: v.numpy().copy() for k, v in r.items()}


@contextlib.contextmanager
def simulated_cuda_tensors() -> Iterator[None]:
    """Make engine.kernels' torch API take its CUDA branch for CPU tensors: the simulator has no
    __cuda_array_interface__ import or external streams, and torch here has no CUDA, so the few calls that
    need them are replaced (tensors become NumPy views, streams 0). Everything else in that branch, the
    launchers and the kernels, runs as written."""
    import torch
    from numba import cuda

    from engine.kernels import kv_quant

    def no_cpu_kernels() -> None:
        raise AssertionError("the CUDA branch called the CPU kernels")

    stream = types.SimpleNamespace(cuda_stream=0)
    with mock.patch.object(kv_quant, "_uses_cuda", lambda t: True), \
            mock.patch.object(kv_quant, "cpu_kernels", no_cpu_kernels), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: stream), \
            mock.patch.object(cuda, "external_stream", lambda ptr: 0, create=True), \
            mock.patch.object(cuda, "as_cuda_array", lambda t, sync=True: t.numpy(), create=True):
        yield


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------------------------------------

def main() -> int:
    from numba.core import config

    if not config.ENABLE_CUDASIM:
        print("run me with NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2
    from engine.kernels.targets import build_cpu_kernels, build_cuda_kernels

    # The simulator computes on NumPy scalars, which warn on IEEE inf / NaN results (in every thread).
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    start = time.perf_counter()
    cpu, gpu = build_cpu_kernels(), build_cuda_kernels()
    rng = np.random.default_rng(int(os.environ.get("KV_QUANT_SEED", "0")))
    failures = []
    for name, x in scalar_cases(rng, n_random=1000).items():
        want, got = cpu_map(cpu, name)(x), gpu_map(gpu, name)(x)
        print(f"scalar {name}: {x.size} inputs, {'ok' if same_bits(want, got) else 'MISMATCH'}")
        if not same_bits(want, got):
            failures.append(name)
    x = make_pages(rng, (3, 4, 2, 32))  # [P, bs, H, D], small: each simulated thread runs in Python
    for dtype in ("bf16", "fp32"):
        raw, shift = as_bits(x, dtype)
        want, got = run_pages(cpu, raw, shift, gpu=False), run_pages(gpu, raw, shift, gpu=True)
        for key in want:
            ok = same_bits(want[key], got[key])
            print(f"pages {dtype} {key}: {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"{dtype}/{key}")
    for dtype in ("bf16", "fp32"):
        import torch

        pages_t = torch.from_numpy(x).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        want = host_api_results(pages_t)
        with simulated_cuda_tensors():
            got = host_api_results(pages_t)
        for key in want:
            ok = same_bits(want[key], got[key])
            print(f"host API {dtype} {key}: {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"api/{dtype}/{key}")
    print(f"{len(failures)} mismatches in {time.perf_counter() - start:.1f} s: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
