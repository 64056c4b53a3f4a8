"""Kernel builds keyed by the CPU features and the sources (engine/kernels/extension_build.py)."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from engine.backends import CpuKernelBackend, CpuKernelConfig, select_backend
from engine.kernels import cpu_ext
from engine.kernels import extension_build as build
from engine.kernels.extension_build import KernelBuildError
from tests.kernel_helpers import require_kernels

AMX = ("avx2", "avx512f", "avx512bf16", "amx-tile", "amx-bf16")
ZEN = ("avx2", "avx512f", "avx512bf16")


def test_two_cpus_get_two_build_directories():
    amx, zen = build.build_key(AMX), build.build_key(ZEN)
    assert amx.name != zen.name and build.build_directory(amx) != build.build_directory(zen)
    assert amx.name.startswith("phase_serve_cpu_ext_amx_") and zen.name.startswith("phase_serve_cpu_ext_avx512bf16_")
    assert amx.name.isidentifier() and zen.name.isidentifier()  # the extension's module name
    assert build.build_key(AMX) == amx  # the same sources and CPU: the same key


def test_the_key_follows_the_sources(tmp_path, monkeypatch):
    before = build.build_key(ZEN)
    edited = tmp_path / "vec.h"
    edited.write_bytes(build.HEADERS[-1].read_bytes() + b"\n// edited\n")
    monkeypatch.setattr(build, "HEADERS", build.HEADERS[:-1] + (edited,))
    assert build.build_key(ZEN).digest != before.digest


def test_cpuinfo_flags_map_to_the_compiler_names(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 ht\n")
    assert build._cpuinfo_features(cpuinfo) == ("avx2", "avx512f", "avx512bf16", "amx-tile", "amx-bf16")
    assert build._cpuinfo_features(tmp_path / "missing") == ()
    assert build.isa_tag(()) == "base" and build.isa_tag(("avx2",)) == "avx2"


def test_a_compiler_that_fails_is_a_clear_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    key = build.build_key(ZEN)
    assert not build.is_built(key)
    with caplog.at_level(logging.INFO, logger=build.__name__), pytest.raises(KernelBuildError, match="--enforce-eager"):
        build.load(key)
    assert any("building the CPU kernels" in r.getMessage() for r in caplog.records)  # a build did start


def test_a_built_key_loads_without_building(caplog):
    require_kernels()
    key = build.build_key()
    assert build.is_built(key)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        build.load(key)
    assert not any("building" in r.getMessage() for r in caplog.records)


def test_a_lock_left_by_a_killed_build_does_not_block_loading():
    require_kernels()
    key = build.build_key()
    stale = build.build_directory(key) / "lock"  # what torch leaves behind when its build is killed
    stale.touch()
    try:
        module = build.load(key)  # waiting on the stale lock would hang here until the test's timeout
        assert hasattr(module, "DecodeStack")  # the pybind half, besides the torch operators
        x = torch.randn(2, 8, dtype=torch.bfloat16)
        normed = torch.ops.phase_serve.rms_norm_bf16(x, None, torch.ones(8, dtype=torch.bfloat16), 1e-6)[0]
        assert torch.allclose(normed.float(), torch.nn.functional.rms_norm(x.float(), (8,), eps=1e-6), atol=2e-2)
    finally:
        stale.unlink(missing_ok=True)


def test_the_build_lock_is_released_when_its_holder_dies(tmp_path):
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
                               str(tmp_path / "build.flock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    with build._build_lock(tmp_path, exclusive=True):  # would wait for ever if the dead holder kept it
        pass


def test_the_backend_is_chosen_from_device_dtype_and_enforce_eager():
    require_kernels()
    kernels = select_backend("cpu", torch.bfloat16, enforce_eager=False)
    described = kernels.describe()
    assert isinstance(kernels, CpuKernelBackend) and described["backend"] == "cpu-kernels"
    assert described["build_key"] == cpu_ext.key().name and described["matrix_engine"] == kernels.engine
    assert ("decode_stack" in described["kernels"]) == kernels.stacks
    for eager in (select_backend("cpu", torch.bfloat16, enforce_eager=True),
                  select_backend("cpu", torch.float32, enforce_eager=False)):
        assert not isinstance(eager, CpuKernelBackend) and eager.describe()["kernels"] == []
    plain = CpuKernelBackend(replace(CpuKernelConfig(), fused_elementwise=False, decode_stack=False))
    assert not {"rms_norm", "rotary", "silu_mul", "decode_stack"} & set(plain.describe()["kernels"])


def test_every_kernel_path_this_cpu_has_features_for_was_built():
    """The kernel tests skip where a path was not built (require_kernels, the engine fixtures), so a build that
    lost a feature this CPU has (a compiler too old for -march=native, a flag dropped) would only show as more
    skips. Each path's features, read from /proc/cpuinfo, against what the loaded extension reports."""
    require_kernels()
    has = set(build._cpuinfo_features())
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= has
    expected = {
        "vectorized (AVX-512)": avx512,
        "int4_vectorized (AVX2, FMA, F16C)": {"avx2", "fma", "f16c"} <= has,
        "w8a8_vnni (AVX-512 VNNI)": avx512 and "avx512vnni" in has,
        "w4a8_vnni (AVX-512 VNNI)": avx512 and "avx512vnni" in has,
        "vectors engine (AVX-512 BF16)": {"avx512bf16", "avx512bw"} <= has,
        "tiles engine (AMX)": {"avx512bf16", "avx512bw", "amx-tile", "amx-bf16"} <= has,
    }
    built = {
        "vectorized (AVX-512)": cpu_ext.vectorized(),
        "int4_vectorized (AVX2, FMA, F16C)": cpu_ext.int4_vectorized(),
        "w8a8_vnni (AVX-512 VNNI)": cpu_ext.w8a8_vnni(),
        "w4a8_vnni (AVX-512 VNNI)": cpu_ext.w4a8_vnni(),
        "vectors engine (AVX-512 BF16)": "vectors" in cpu_ext.matrix_engines(),
        "tiles engine (AMX)": "tiles" in cpu_ext.matrix_engines(),
    }
    assert built == expected, f"this CPU has {sorted(has)}"


def test_the_ahead_of_time_build_compiles_the_page_quantisers_for_bf16_and_fp32_pages(monkeypatch):
    """`make kernels` compiles numba's page quantisers for both page dtypes (raw bits int16 for bf16, int32 for fp32),
    so that no later process compiles them at its first quantised page. Fresh dispatchers: this process's shared
    ones may have been called by other tests."""
    from engine.kernels import kv_quant
    from engine.kernels.targets import build_cpu_kernels

    kernels = build_cpu_kernels()
    monkeypatch.setattr(kv_quant, "cpu_kernels", lambda: kernels)
    kv_quant.compile_cpu_kernels()
    for driver in (kernels.fp8_quantize_pages, kernels.fp8_dequantize_pages, kernels.fp4_quantize_pages,
                   kernels.fp4_dequantize_pages):
        signatures = " ".join(map(str, driver.signatures))
        assert "int16" in signatures and "int32" in signatures, (driver, signatures)
