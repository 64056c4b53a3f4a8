"""The GPU backend's selection with the device faked: which backend and attention a CUDA engine gets from
--enforce-eager, --gpu-attention and the packages that import, whether its decode steps are captured as CUDA
graphs, FlashInfer's wiring (a stand-in module records its calls), and the compiled elementwise ops' fallback.
Nothing here touches a GPU: building the backend must not."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from tests.triton_interpreter import kernels

kernels()  # before the backend imports them (tests/triton_interpreter.py)
from engine.backends import CudaBackend, GpuConfig, TorchBackend, select, select_backend  # noqa: E402
from engine.backends.attention import AttentionMetadata  # noqa: E402
from engine.backends.cuda_ops import CompiledOps, _rms_norm  # noqa: E402
from engine.backends.flashinfer_attention import paged_csr  # noqa: E402
from engine.backends.gpu_config import resolve_attention  # noqa: E402
from engine.config import ConfigError, EngineConfig, ModelConfig  # noqa: E402
from engine.core.cuda_graphs import GraphPlan, graph_plan, graph_refusal  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.kv.groups import KVGroups  # noqa: E402
from engine.sampling.sampler import SamplingBatch, dense_distribution, sample, warm_dense  # noqa: E402
from engine.sampling.sampling_params import SamplingParams  # noqa: E402


def installed(monkeypatch, *packages: str) -> None:
    monkeypatch.setattr(select, "importable", lambda name: name in packages)


def test_a_cuda_engine_gets_the_triton_backend_without_touching_the_gpu(monkeypatch):
    installed(monkeypatch, "triton")
    backend = select_backend("cuda:1", torch.bfloat16, enforce_eager=False)
    assert type(backend) is CudaBackend and backend.device == torch.device("cuda:1")
    assert backend.attends_in_place and backend.captures_decode and backend.flashinfer is None
    assert backend.describe()["kernels"] == ["triton_paged_attention", "triton_store_kv", "compiled_elementwise"]


def test_enforce_eager_and_other_devices_keep_plain_torch(monkeypatch):
    installed(monkeypatch, "triton", "flashinfer")
    for device, dtype, eager in (("cuda", torch.float16, True), ("cpu", torch.float32, False),
                                 ("mps", torch.float16, False)):
        backend = select_backend(device, dtype, enforce_eager=eager)
        assert type(backend) is TorchBackend and not backend.captures_decode, (device, eager)


def test_auto_without_triton_falls_back_to_plain_torch_with_a_warning(monkeypatch, caplog):
    installed(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=select.__name__):
        backend = select_backend("cuda", torch.bfloat16, enforce_eager=False)
    assert type(backend) is TorchBackend and "Triton does not import" in caplog.text


def test_the_attention_rule():
    assert resolve_attention("auto", True, True) == "triton"  # FlashInfer only where asked for
    assert resolve_attention("auto", False, True) == "torch"
    assert resolve_attention("flashinfer", True, True) == "flashinfer"
    assert resolve_attention("triton", True, False) == "triton"
    with pytest.raises(ValueError, match="--gpu-attention flashinfer needs the flashinfer package"):
        resolve_attention("flashinfer", True, False)
    with pytest.raises(ValueError, match="--gpu-attention triton needs the triton package"):
        resolve_attention("triton", False, True)


def test_bad_gpu_options_are_refused_naming_them():
    with pytest.raises(ConfigError, match="gpu_attention must be one of auto, triton, flashinfer"):
        EngineConfig(gpu_attention="cudnn")
    with pytest.raises(ConfigError, match="cuda_graphs must be one of auto, off"):
        EngineConfig(cuda_graphs="on")
    with pytest.raises(ValueError, match="max_splits must be a power of two"):
        GpuConfig(max_splits=6)


def kv_cache(kv_format: str = "auto", groups: KVGroups | None = None) -> KVCache:
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    return KVCache(cfg, 8, 16, torch.float16, "cpu", kv_format=kv_format, groups=groups)


def test_graphs_are_captured_only_on_cuda_with_a_capturable_backend_and_plain_pages(monkeypatch):
    installed(monkeypatch, "triton", "flashinfer")
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    triton_backend = select_backend("cuda", torch.float16, enforce_eager=False)
    plain = kv_cache()
    assert graph_refusal("auto", "cuda", triton_backend, plain) is None
    plan = graph_plan("auto", "cuda", triton_backend, plain, max_num_seqs=20, max_model_len=100)
    assert plan == GraphPlan((1, 2, 4, 8, 16, 24), max_blocks=7, block_size=16)
    flashinfer_backend = select_backend("cuda", torch.float16, False, gpu=GpuConfig(attention="flashinfer"))
    refusals = {
        "off": graph_refusal("off", "cuda", triton_backend, plain),
        "cpu": graph_refusal("auto", "cpu", triton_backend, plain),
        "eager": graph_refusal("auto", "cuda", select_backend("cuda", torch.float16, True), plain),
        "flashinfer": graph_refusal("auto", "cuda", flashinfer_backend, plain),
        "fp8": graph_refusal("auto", "cuda", triton_backend, kv_cache("fp8")),
        "no pool": graph_refusal("auto", "cuda", triton_backend, None),
        "groups": graph_refusal("auto", "cuda", triton_backend, kv_cache(groups=KVGroups(1, (0, 1), (0, 0),
                                                                                         (None, 8)))),
    }
    assert all(refusals.values()), refusals
    assert "--cuda-graphs off" in refusals["off"] and "fp8" in refusals["fp8"]
    assert graph_plan("auto", "cpu", triton_backend, plain, 20, 100) is None


class FakeWrapper:
    """FlashInfer's decode wrapper as far as the backend uses it: records each plan and run."""

    def __init__(self, log: list, workspace: torch.Tensor, layout: str) -> None:
        self.log = log
        log.append(("new", layout, workspace.numel()))

    def plan(self, *args, **kwargs) -> None:
        self.log.append(("plan", args, kwargs))

    def run(self, q: torch.Tensor, caches: tuple) -> torch.Tensor:
        self.log.append(("run", q.shape, caches[0].shape))
        return torch.full_like(q, 7.0)


def test_flashinfer_decode_plans_once_a_step_per_window_and_runs_every_layer(monkeypatch):
    calls: list = []
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = lambda workspace, layout: FakeWrapper(calls, workspace, layout)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    backend = CudaBackend("cpu", GpuConfig(attention="flashinfer", compile_elementwise=False), processors=1)
    assert not backend.captures_decode and "flashinfer_decode" in backend.describe()["kernels"]
    pages = torch.zeros(10, 4, 2, 16)
    meta = AttentionMetadata.build(4, [([3, 5], 6), ([7], 1)], [], use_kernels=True)
    q = torch.randn(2, 4, 16)
    for window in (None, None, 3):  # two layers without a window, one with
        assert torch.equal(backend.decode_attention(q, pages, pages, meta, 0.5, window), torch.full_like(q, 7.0))
    plans = [c for c in calls if c[0] == "plan"]
    assert [c[0] for c in calls].count("run") == 3 and len(plans) == 2
    args, kwargs = plans[0][1], plans[0][2]
    assert [a.tolist() for a in args[:3]] == [[0, 2, 3], [3, 5, 7], [2, 1]]
    assert args[3:] == (4, 2, 16, 4) and kwargs["window_left"] == -1 and kwargs["sm_scale"] == 0.5
    assert plans[1][2]["window_left"] == 2  # window 3: the query and the two keys before it


def test_paged_csr_keeps_each_rows_used_blocks():
    tables = torch.tensor([[4, 9, 0, 0], [2, 6, 8, 1], [5, 0, 0, 0]])
    indptr, indices, last = paged_csr(tables, torch.tensor([5, 16, 1]), 4)
    assert indptr.tolist() == [0, 2, 6, 7] and indices.tolist() == [4, 9, 2, 6, 8, 1, 5]
    assert last.tolist() == [1, 4, 1] and indices.dtype == torch.int32


def test_compiled_ops_fall_back_to_plain_torch_once_when_compiling_fails(monkeypatch, caplog):
    attempts = []

    def failing_compile(fn, **kwargs):
        attempts.append(fn)

        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    ops = CompiledOps(enabled=True)
    x, w = torch.randn(3, 8), torch.rand(8)
    with caplog.at_level(logging.WARNING):
        first, second = ops(_rms_norm, x, w, 1e-5), ops(_rms_norm, x, w, 1e-5)
    want = TorchBackend().rms_norm(x, w, 1e-5)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert attempts == [_rms_norm] and caplog.text.count("torch.compile of _rms_norm failed") == 1
    assert CompiledOps(enabled=False)(_rms_norm, x, w, 1e-5).equal(want) and attempts == [_rms_norm]


def test_the_sampler_distribution_is_compiled_once_warmed_in_each_variant_and_samples_the_same(monkeypatch):
    """A CUDA backend compiles the sampler's dense_distribution (torch.compile recorded here, not run); the
    warm-up calls it in the four shapes a compiler specialises; seeded draws through it equal the plain path's.
    Plain torch backends, and a CUDA one with compiled elementwise ops off, fuse nothing."""
    compiled, calls = [], []

    def recording_compile(fn, **kwargs):
        compiled.append((fn, kwargs))

        def run(*args):
            calls.append((args[0].shape[0], args[-1]))
            return fn(*args)
        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    backend = CudaBackend("cpu", GpuConfig(attention="triton"), processors=1)
    dense = backend.fuse(dense_distribution)
    assert warm_dense(dense, 50, "cpu") == 4
    assert compiled == [(dense_distribution, {"dynamic": True})]
    assert sorted(calls) == [(1, False), (1, True), (2, False), (2, True)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=1.2, min_p=0.1, seed=4),
              SamplingParams(temperature=0.0)]

    def draws(dense_fn):
        batch = SamplingBatch.build(params, [torch.Generator().manual_seed(p.seed or 0) for p in params],
                                    [()] * 3, "cpu")
        return [sample(logits, batch, dense=dense_fn).token_ids for _ in range(20)]

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(7)) * 2
    assert draws(dense) == draws(None) and calls[-1] == (3, True)
    assert TorchBackend().fuse(dense_distribution) is None
    assert CudaBackend("cpu", GpuConfig(attention="triton", compile_elementwise=False),
                       processors=1).fuse(dense_distribution) is None
