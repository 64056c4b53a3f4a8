"""Compile the plain-Python kernel sources for the CPU (numba.njit) and the GPU (numba.cuda.jit).

Building is lazy: nothing is compiled, and numba.cuda is not imported, until a builder is called; njit and
cuda.jit dispatchers compile on their first call. `cpu_kernels()` / `cuda_kernels()` memoise their result
(functools.cache) so each process compiles once; `build_*` give fresh, unshared dispatchers (tests).
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Iterable

import numba

from engine.kernels import kv_quant_src as src


def retarget(funcs: Iterable[Callable], decorate: Callable[[Callable], Any],
             bound: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compile `funcs` (in dependency order) with `decorate`, each one seeing the compiled versions of the
    functions compiled before it (and of `bound`) under their own names instead of the plain ones.

    The clone shares the original's code object, so it is the same source compiled again; only the
    globals it resolves at compile time differ."""
    compiled: dict[str, Any] = dict(bound or {})
    for func in funcs:
        namespace = dict(func.__globals__)
        namespace.update(compiled)
        clone = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__,
                                   func.__closure__)
        clone.__qualname__ = func.__qualname__
        clone.__module__ = func.__module__
        clone.__doc__ = func.__doc__
        compiled[func.__name__] = decorate(clone)
    return compiled


def build_cpu_kernels() -> types.SimpleNamespace:
    """Scalar helpers, per-element logic and page drivers compiled with numba.njit (cached on disk).

    One set of options per function: numba's cache key ignores compile options, so a second variant of the
    same function (say parallel=False) would read the other's cached code."""
    # error_model="numpy": float division by zero gives inf / NaN as on the GPU, with no check per division.
    def njit_device(func: Callable) -> Any:
        inline = "always" if func.__name__ in src.NJIT_INLINE else "never"
        return numba.njit(cache=True, error_model="numpy", inline=inline)(func)

    device = retarget(src.DEVICE_FUNCTIONS, njit_device)
    drivers = retarget(src.CPU_DRIVERS, numba.njit(cache=True, error_model="numpy", parallel=True),
                       bound=device)
    return types.SimpleNamespace(**drivers)


def build_cuda_kernels() -> types.SimpleNamespace:
    """The same scalar helpers and per-element logic as CUDA device functions, plus the CUDA kernels.
    Works on a machine without a GPU only under NUMBA_ENABLE_CUDASIM=1 (launching needs a device)."""
    from numba import cuda

    from engine.kernels import cuda_drivers

    device = retarget(src.DEVICE_FUNCTIONS, cuda.jit(device=True))
    kernels = retarget(cuda_drivers.KERNELS, cuda.jit, bound=device)
    return types.SimpleNamespace(**kernels)


@functools.cache
def cpu_kernels() -> types.SimpleNamespace:
    return build_cpu_kernels()


@functools.cache
def cuda_kernels() -> types.SimpleNamespace:
    return build_cuda_kernels()
