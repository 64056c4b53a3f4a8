"""Shared by the kernel tests: the kernels checked in fixtures (never at collection), spies on the compiled
kernels, and models on a CPU kernel backend of a given config."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.backends import CpuKernelBackend, CpuKernelConfig, KernelBuildError
from engine.backends.dispatch import Route
from engine.kernels import cpu_ext, packed_linear
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import LlamaModel, build_model


def require_kernels(vectors: bool = False, matrix_engine: bool = False, onednn: bool = False) -> None:
    """Skips the calling test (or fixture) where this CPU lacks the part of the kernels it needs. Kernels that
    fail to build or load fail the test: serving refuses to start without them too (unless --enforce-eager)."""
    try:
        cpu_ext.extension()
    except KernelBuildError as exc:
        pytest.fail(f"the CPU kernels did not build or load: {exc}")
    if vectors and not cpu_ext.vectorized():
        pytest.skip("the CPU kernels were built without AVX-512")
    if matrix_engine and not cpu_ext.matrix_engines():
        pytest.skip("neither AMX tiles nor AVX-512 BF16 on this CPU")
    if onednn and not packed_linear.onednn_available():
        pytest.skip("oneDNN does not pack bf16 weights on this CPU (or this torch has no packing ops)")


@pytest.fixture
def on_engine(request) -> str:
    """A matrix engine by name (indirect parametrisation), skipped where this CPU does not have it."""
    require_kernels(matrix_engine=True)
    if request.param not in cpu_ext.matrix_engines():
        pytest.skip(f"no {request.param} engine on this CPU")
    return request.param


class KernelCalls(list):
    """(kernel name, rows of its first operand) of every call into the extension while a test runs, and the
    (query rows, count, context) of each prompt-attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_counts: list[tuple[int, int, int]] = []
        self.paged_prompts = 0  # prompt-attention calls that read their keys in place from the pages

    def names(self) -> list[str]:
        return [name for name, _ in self]

    def rows(self, name: str) -> list[int]:
        return [rows for called, rows in self if called == name]

    def count(self, name: str) -> int:  # type: ignore[override]
        return len(self.rows(name))


KERNELS = ("linear_bf16", "decode_attention_bf16", "decode_attention_fp8", "rms_norm_bf16", "silu_mul_bf16",
           "rotary_bf16_", "tiled_linear_bf16", "tiled_linear_silu_mul_bf16",
           "tiled_linear_argmax_bf16", "prompt_attention_bf16")
ONEDNN = "onednn_packed_linear"


@pytest.fixture
def kernel_calls(monkeypatch) -> KernelCalls:
    """Spies on the kernels' operators (torch.ops.phase_serve.*, what cpu_ext calls) and on oneDNN's packed
    product. The decode stack calls its kernels inside C++: a test that counts them runs the Python layers
    (decode_stack=False)."""
    require_kernels()
    calls = KernelCalls()
    ops = cpu_ext.ops()
    for name in KERNELS:
        monkeypatch.setattr(ops, name, _spy(calls, name, getattr(ops, name)))
    if packed_linear.onednn_available():
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            _spy(calls, ONEDNN, torch.ops.mkldnn._linear_pointwise))
    return calls


def _spy(calls: KernelCalls, name: str, func):
    def wrapped(*args):
        calls.append((name, args[0].shape[0]))
        if name == "prompt_attention_bf16":
            calls.prompt_counts.append((args[0].shape[0], args[3], args[6] if len(args) > 6 else 0))
            calls.paged_prompts += len(args) > 7 and args[7] is not None
        return func(*args)
    return wrapped


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """Rows of every step that went through the decode stack."""
    calls: list[int] = []
    run = CpuKernelBackend.decode_layers

    def spy(self, stack, x, *args):
        out = run(self, stack, x, *args)
        if out is not None:
            calls.append(x.shape[0])
        return out

    monkeypatch.setattr(CpuKernelBackend, "decode_layers", spy)
    return calls


def kernel_backend(**changes) -> CpuKernelBackend:
    return CpuKernelBackend(replace(CpuKernelConfig(), **changes))


def routed_backend(monkeypatch, op: str, fmt: str, points: list[tuple[int, str]]) -> tuple[CpuKernelBackend, list[int]]:
    """A backend whose measured table routes `fmt` by `points` (Route.from_points), and the row counts that reach
    the extension's `op` through it, recorded as they come."""
    rows_seen: list[int] = []
    kernel = getattr(cpu_ext.ops(), op)
    monkeypatch.setattr(cpu_ext.ops(), op, lambda x, *args: rows_seen.append(len(x)) or kernel(x, *args))
    table = replace(CpuKernelBackend().dispatch, **{fmt: Route.from_points(points)}, measured=(fmt,))
    return CpuKernelBackend(CpuKernelConfig(dispatch=table)), rows_seen


def kernel_model(folder, **changes) -> LlamaModel:
    """The bf16 model of `folder` on a CPU kernel backend, its config changed by `changes`."""
    model = build_model(read_hf_config(folder), iter_hf_weights(folder), torch.bfloat16)
    model.set_backend(kernel_backend(**changes))
    return model


def reconfigure(model: LlamaModel, **changes) -> None:
    """Puts the model on a kernel backend whose config is its present one changed by `changes`."""
    model.set_backend(CpuKernelBackend(replace(model.backend.config, **changes)))
