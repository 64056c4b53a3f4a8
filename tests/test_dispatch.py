"""The kernel dispatch table (engine/backends/dispatch.py): the kernels valid on each kind of CPU (features faked),
the tables built for each naming only those, the measurement keeping the fastest kernel under a fake timer, the
table remembered in the disk cache (a damaged entry a miss), the builder's wiring, and every kernel a table built
on this machine may name passing its exactness check here. Nothing here times anything."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from engine.backends import CpuKernelBackend, CpuKernelConfig, TorchBackend
from engine.backends import dispatch_store, weight_ops
from engine.backends.dispatch import (ENGINES, FORMATS, KERNELS, PACKED, PRUNE_FACTOR, REPS, DispatchTable, Route,
                                      choose_table, native_bf16, row_buckets, valid_kernels)
from engine.backends.dispatch_store import Measured, measured_table
from engine.backends.kernel_timing import KernelTimer, Workload
from engine.config import EngineConfig
from engine.core.builder import build_engine_core, kernel_workload
from engine.disk_cache import DiskCache
from engine.kernels import cpu_ext
from engine.model import quant
from engine.model.progress import MEASURING_KERNELS
from tests.kernel_helpers import kernel_calls, require_kernels  # noqa: F401 (fixture)
from tests.test_weight_int4 import assert_rounded_once, dequantised, int4_weight, reference_w4a8
from tests.test_weight_int8 import reference_int8, reference_w8a8

BASE = ("avx2", "fma", "f16c")
AVX512 = BASE + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni")  # Ice Lake: no BF16, no AMX
AVX512_BF16 = AVX512 + ("avx512bf16",)  # AMD Zen 4 / Zen 5
AMX = AVX512_BF16 + ("avx512fp16", "amx-tile", "amx-bf16")  # Sapphire Rapids
CPUS = {"amx": AMX, "avx512-bf16": AVX512_BF16, "avx512": AVX512, "avx2": BASE}
ROWS = range(1, 5000)  # past every bucket a step reaches
BUCKETS = row_buckets(4096)
QUANTISED_ACTIVATIONS = CpuKernelConfig(max_w8a8_rows=64, max_w4a8_rows=64)  # W8A8 and W4A8 asked for


def faked_candidates(features: tuple[str, ...], config: CpuKernelConfig = CpuKernelConfig()) -> dict:
    """What a backend on a CPU of `features` would let a table name: its valid kernels, the packed blocks on the
    first engine ("auto": tiles before vectors)."""
    valid = valid_kernels(features)
    engine = next((e for e in ENGINES if e in valid["bf16"]), None)
    return config.candidates(valid, engine)


def cost(fmt: str, kernel: str, rows: int) -> float:
    """A fake timer's seconds: the streaming kernels win a few rows, the packed copies more, F.linear the most."""
    fixed, per_row = {"gemv": (1.0, 1.0), "int8": (1.0, 1.2), "int4": (1.0, 0.8), "w8a8": (0.8, 0.9),
                      "w4a8": (0.8, 0.7), "int4_gemm": (1.2, 0.35), "int4_bf16": (2.0, 0.2), "tiles": (3.0, 0.2),
                      "vectors": (3.5, 0.22), "int8g_bf16": (2.0, 0.25),
                      "onednn": (4.0, 0.3), "int8g": (1.0, 1.1), "linear": (8.0, 0.25), "linear32": (9.0, 0.24)}[kernel]
    return fixed + per_row * rows + (2.0 if fmt != "bf16" and kernel in ("linear", "linear32") else 0.0)


def assert_valid_for(table: DispatchTable, features: tuple[str, ...]) -> None:
    valid = valid_kernels(features)
    for fmt in FORMATS:
        route = table.route(fmt)
        for rows in ROWS:
            kernel = route.kernel(rows)
            assert kernel in valid[fmt], f"{fmt} at {rows} rows: {kernel} is not valid on {features}"
            assert rows >= 2 or kernel not in PACKED


# ---- valid kernels and the tables built for each kind of CPU --------------------------------------------------


def test_each_kind_of_cpu_has_the_kernels_its_features_build():
    fl = ("linear", "linear32")  # F.linear in bf16 and in fp32: everywhere
    int8g = {"int8g": ("int8g",) + fl}  # its vector code needs no more than its scalar loop's build
    int8g_bf16 = {"int8g": ("int8g", "int8g_bf16") + fl}
    assert valid_kernels(AMX) == {"bf16": ("gemv", "tiles", "vectors", "onednn") + fl, "int8": ("w8a8", "int8") + fl,
                                  "int4": ("w4a8", "int4", "int4_gemm", "int4_bf16") + fl, **int8g_bf16}
    assert valid_kernels(AVX512_BF16)["bf16"] == ("gemv", "vectors", "onednn") + fl
    assert valid_kernels(AVX512_BF16)["int4"] == ("w4a8", "int4", "int4_gemm", "int4_bf16") + fl
    assert valid_kernels(AVX512) == {"bf16": ("gemv", "onednn") + fl, "int8": ("w8a8", "int8") + fl,
                                     "int4": ("w4a8", "int4", "int4_gemm") + fl, **int8g}
    assert valid_kernels(BASE) == {"bf16": ("gemv",) + fl, "int8": ("int8",) + fl, "int4": ("int4",) + fl, **int8g}
    assert valid_kernels(()) == {"bf16": ("gemv",) + fl, "int8": ("int8",) + fl, "int4": fl, **int8g}
    assert [cpu for cpu, features in CPUS.items() if native_bf16(features)] == ["amx", "avx512-bf16"]


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("config", [CpuKernelConfig(), QUANTISED_ACTIVATIONS], ids=["default", "w8a8-w4a8"])
def test_the_shipped_table_for_each_kind_of_cpu_names_valid_kernels(cpu, config):
    table = config.shipped_table(faked_candidates(CPUS[cpu], config), native_bf16(CPUS[cpu]))
    assert table.source == "shipped"
    assert_valid_for(table, CPUS[cpu])


def test_the_shipped_tables_are_the_row_limits():
    """F.linear in bf16 where the CPU has bf16 dot products, in fp32 (linear32) where it has not."""
    expected = {"amx": "1: gemv, 2-1024: tiles, 1025+: linear",
                "avx512-bf16": "1: gemv, 2-4096: vectors, 4097+: linear",
                "avx512": "1: gemv, 2-128: onednn, 129+: linear32", "avx2": "1-5: gemv, 6+: linear32"}
    for cpu, features in CPUS.items():
        table = CpuKernelConfig().shipped_table(faked_candidates(features), native_bf16(features))
        linear = "linear" if native_bf16(features) else "linear32"
        assert table.bf16.describe() == expected[cpu]
        assert table.int8.describe() == f"1-64: int8, 65+: {linear}"
        assert table.int4.describe() == f"1-64: int4, 65+: {linear}"
    asked = QUANTISED_ACTIVATIONS.shipped_table(faked_candidates(AVX512, QUANTISED_ACTIVATIONS), True)
    assert asked.int8.describe() == "1-64: w8a8, 65+: linear" and asked.int4.describe() == "1-64: w4a8, 65+: linear"
    no_vnni = QUANTISED_ACTIVATIONS.shipped_table(faked_candidates(BASE, QUANTISED_ACTIVATIONS), True)
    assert no_vnni.int8.describe() == "1-64: int8, 65+: linear"  # W8A8 asked for, but no VNNI to run it
    for forced, linear in ((True, "linear32"), (False, "linear")):  # linear_fp32 set: whatever the CPU has
        config = CpuKernelConfig(linear_fp32=forced)
        for features in CPUS.values():
            candidates = faked_candidates(features, config)
            assert all(linear in kernels and len(set(kernels) & {"linear", "linear32"}) == 1
                       for kernels in candidates.values())
            table = config.shipped_table(candidates, native_bf16(features))
            assert table.int4.describe() == f"1-64: int4, 65+: {linear}"


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("config", [CpuKernelConfig(), QUANTISED_ACTIVATIONS], ids=["default", "w8a8-w4a8"])
def test_a_measured_table_for_each_kind_of_cpu_names_valid_kernels(cpu, config):
    candidates = faked_candidates(CPUS[cpu], config)
    base = config.shipped_table(candidates, native_bf16(CPUS[cpu]))
    table, timings = choose_table(candidates, BUCKETS, cost, base, config.row_caps())
    assert table.source == "measured" and set(timings) == set(FORMATS)
    assert_valid_for(table, CPUS[cpu])
    # the fake timer makes the packed copy win the middle rows: the engine's blocks where one runs
    assert table.packing() == {"amx": "tiles", "avx512-bf16": "vectors", "avx512": "onednn", "avx2": None}[cpu]


# ---- the measurement's choice ------------------------------------------------------------------------------


def scripted(times: dict[str, dict[int, float]], calls: list | None = None):
    """A fake timer reading `times[kernel][rows]`, recording each (format, kernel, rows) it is asked."""
    def timer(fmt: str, kernel: str, rows: int) -> float:
        if calls is not None:
            calls.append((fmt, kernel, rows))
        return times[kernel][rows]
    return timer


def shipped() -> DispatchTable:
    return CpuKernelConfig().shipped_table(faked_candidates(AVX512), native_bf16(AVX512))


def test_the_measurement_keeps_the_fastest_kernel_of_each_bucket():
    buckets = row_buckets(256)
    times = {"gemv": {1: 1, 2: 2, 4: 3, 8: 9, 16: 30, 32: 90, 64: 200, 128: 400, 256: 800},
             "onednn": {2: 5, 4: 6, 8: 7, 16: 8, 32: 10, 64: 20, 128: 41, 256: 90},
             "linear": {1: 4, 2: 9, 4: 9, 8: 9, 16: 10, 32: 12, 64: 21, 128: 40, 256: 80}}
    calls: list = []
    table, timings = choose_table({"bf16": ("gemv", "onednn", "linear")}, buckets, scripted(times, calls), shipped())
    # bucket b's winner serves the rows past the bucket before it: 3-4 rows go with 4, 5-8 with 8
    assert table.bf16 == Route.from_points([(1, "gemv"), (5, "onednn"), (65, "linear")])
    assert table.bf16.kernel(4) == "gemv" and table.bf16.kernel(5) == "onednn" and table.bf16.kernel(10_000) == "linear"
    assert table.int8 == shipped().int8 and table.int4 == shipped().int4  # formats not measured keep the base's
    assert table.measured == ("bf16",) and table.describe()["int8"] == "1-64: int8, 65+: linear32 (shipped)"
    # the GEMV fell more than PRUNE_FACTOR behind at 16 rows: no larger bucket timed it; no packed copy at one row
    assert list(dict.fromkeys(rows for _, kernel, rows in calls if kernel == "gemv")) == [1, 2, 4, 8, 16]
    assert calls.count(("bf16", "gemv", 8)) == REPS
    assert ("bf16", "onednn", 1) not in calls
    assert timings["bf16"][8] == {"gemv": 9, "onednn": 7, "linear": 9}


def test_one_packing_per_table_the_one_that_wins_most_buckets():
    buckets = (1, 2, 4, 8, 16)
    times = {"gemv": {1: 1, 2: 9, 4: 9, 8: 9, 16: 9}, "tiles": {2: 2, 4: 2, 8: 5, 16: 9},
             "onednn": {2: 3, 4: 3, 8: 4, 16: 9}, "linear": {1: 9, 2: 9, 4: 9, 8: 6, 16: 1}}
    table, _ = choose_table({"bf16": ("gemv", "tiles", "onednn", "linear")}, buckets, scripted(times),
                            dataclasses.replace(shipped(), bf16=Route.only("linear")))
    # oneDNN won 8 rows, the tiles 2 and 4: the tiles stay, and 8 goes to the fastest but oneDNN (the tiles)
    assert table.bf16 == Route.from_points([(1, "gemv"), (2, "tiles"), (9, "linear")])


def test_a_streaming_kernel_is_pruned_against_the_kernels_that_serve_the_next_bucket():
    """int4_bf16 (capped at 4 rows) is three times faster than int4 at 4 rows, but 8 rows go to int4 or linear:
    int4 is timed on, wins 8 and 16, and drops out at 32 once it is PRUNE_FACTOR behind linear."""
    calls: list = []
    times = {"int4_bf16": {1: 1, 2: 1, 4: 1}, "int4": {1: 2, 2: 2, 4: 3, 8: 4, 16: 8, 32: 30, 64: 60},
             "linear": {2: 9, 4: 9, 8: 9, 16: 10, 32: 12, 64: 20}}
    table, timings = choose_table({"int4": ("int4", "int4_bf16", "linear")}, row_buckets(64),
                                  scripted(times, calls), shipped(), {"int4_bf16": 4})
    assert table.int4 == Route.from_points([(1, "int4_bf16"), (5, "int4"), (17, "linear")])
    assert list(dict.fromkeys(rows for _, kernel, rows in calls if kernel == "int4")) == [1, 2, 4, 8, 16, 32]
    assert set(timings["int4"][32]) == {"int4", "linear"}


def test_buckets_only_one_kernel_may_serve_are_not_timed():
    """Past the cap of int8g_bf16 and once int8g has fallen behind, linear alone serves: 128 rows and more go to it
    untimed, and progress still counts every bucket."""
    calls: list = []
    heard: list = []
    times = {"int8g": {1: 1, 2: 2, 4: 4, 8: 8, 16: 16, 32: 32, 64: 64},
             "int8g_bf16": {r: 3 for r in (2, 4, 8, 16, 32, 64)}, "linear": {r: 20 for r in (2, 4, 8, 16, 32, 64)}}
    table, timings = choose_table({"int8g": ("int8g", "int8g_bf16", "linear")}, row_buckets(1024),
                                  scripted(times, calls), shipped(), {"int8g_bf16": 64},
                                  lambda done, total: heard.append((done, total)))
    assert table.int8g == Route.from_points([(1, "int8g"), (3, "int8g_bf16"), (65, "linear")])
    assert max(rows for _, _, rows in calls) == 64 and set(timings["int8g"]) == {1, 2, 4, 8, 16, 32, 64}
    assert heard[0] == (0, 11) and heard[-1] == (11, 11) and heard == sorted(heard)


def test_capped_kernels_are_timed_only_up_to_their_cap_and_progress_is_heard():
    calls: list = []
    heard: list = []
    times = {"w8a8": {1: 1, 2: 1, 4: 1, 8: 1, 16: 1}, "int8": {r: 2 for r in (1, 2, 4, 8, 16)},
             "linear": {r: 3 for r in (1, 2, 4, 8, 16)}}
    table, _ = choose_table({"int8": ("w8a8", "int8", "linear")}, row_buckets(16), scripted(times, calls),
                            shipped(), {"w8a8": 4}, lambda done, total: heard.append((done, total)))
    assert list(dict.fromkeys(rows for _, kernel, rows in calls if kernel == "w8a8")) == [1, 2, 4]
    assert table.int8 == Route.from_points([(1, "w8a8"), (5, "int8")])
    assert heard == [(i, 5) for i in range(6)]


def test_a_measurement_refuses_bad_candidates_and_buckets():
    timer = scripted({})
    with pytest.raises(ValueError, match="include one of"):
        choose_table({"bf16": ("gemv",)}, (1, 2), timer, shipped())
    with pytest.raises(ValueError, match="among"):
        choose_table({"int4": ("gemv", "linear")}, (1, 2), timer, shipped())
    with pytest.raises(ValueError, match="rise from 1"):
        choose_table({"bf16": ("gemv", "linear")}, (2, 4), timer, shipped())
    with pytest.raises(ValueError, match="max_rows"):
        row_buckets(0)
    assert row_buckets(1) == (1,) and row_buckets(512) == row_buckets(300) == tuple(2 ** i for i in range(10))


# ---- routes and tables --------------------------------------------------------------------------------------


def test_a_route_maps_every_row_count_to_one_kernel():
    route = Route.from_rule(lambda r: "onednn" if 2 <= r <= 128 else "gemv" if r <= 5 else "linear", (128, 5))
    assert route == Route((1, 128), ("gemv", "onednn", "linear"))
    assert [route.kernel(r) for r in (1, 2, 128, 129, 10 ** 9)] == ["gemv", "onednn", "onednn", "linear", "linear"]
    assert route.describe() == "1: gemv, 2-128: onednn, 129+: linear"
    assert route.last_row("onednn") == 128 and route.last_row("tiles") == 0 and route.last_row("linear") > 10 ** 9
    assert Route.only("tiles").describe() == "1: linear, 2+: tiles" and Route.only("gemv").describe() == "1+: gemv"
    assert Route.from_wire(route.to_wire()) == route
    with pytest.raises(ValueError, match="rise"):
        Route((4, 2), ("gemv", "onednn", "linear"))
    with pytest.raises(ValueError, match="once"):
        Route((4,), ("gemv", "gemv"))
    with pytest.raises(TypeError, match="int bounds"):
        Route.from_wire({"bounds": ["4"], "kernels": ["gemv", "linear"]})


def test_a_table_names_only_its_formats_kernels_and_one_packing():
    table = shipped()
    assert DispatchTable.from_wire(table.to_wire()) == table
    with pytest.raises(ValueError, match="int4 route names"):
        dataclasses.replace(table, int4=Route.only("gemv"))
    with pytest.raises(ValueError, match="one row to tiles"):
        dataclasses.replace(table, bf16=Route((), ("tiles",)))
    with pytest.raises(ValueError, match="two packings"):
        dataclasses.replace(table, bf16=Route.from_points([(1, "gemv"), (2, "tiles"), (9, "onednn")]))
    with pytest.raises(ValueError, match="measured formats"):
        dataclasses.replace(table, measured=("fp8",))


# ---- the backend on a table ---------------------------------------------------------------------------------


def project_choice(limits: tuple[int, ...], rows: int, fmt: str, has_copy: bool) -> str:
    """decode_stack.cpp's project() from its row limits (gemv, oneDNN copy, blocks, int8, W8A8, W4A8, int4,
    int8g, int4 GEMM, int4 and int8g on bf16 dot products)."""
    gemv, packed, tiled, int8, w8a8, w4a8, int4, int8g, int4_gemm, int4_bf16, int8g_bf16 = limits
    if fmt == "int8g":
        return "int8g_bf16" if rows <= int8g_bf16 else "int8g" if rows <= int8g else "linear"
    if fmt == "int4":
        return ("w4a8" if rows <= w4a8 else "int4_bf16" if rows <= int4_bf16 else "int4_gemm" if rows <= int4_gemm
                else "int4" if rows <= int4 else "linear")
    if fmt == "int8":
        return "w8a8" if has_copy and rows <= min(w8a8, int8) else "int8" if rows <= int8 else "linear"
    if has_copy and 2 <= rows <= packed:
        return "packed"
    return "gemv" if rows <= gemv else "linear"


def test_the_decode_stack_limits_make_the_tables_choice_at_every_row_count():
    require_kernels()
    packing = CpuKernelBackend().packing
    if packing is None:
        pytest.skip("no packed copy runs here")
    table = DispatchTable(bf16=Route.from_points([(1, "linear"), (2, packing), (3, "gemv"), (5, "linear")]),
                          int8=Route.from_points([(1, "w8a8"), (3, "int8"), (9, "linear")]),
                          int4=Route.from_points([(1, "int4"), (2, "w4a8"), (4, "int4_gemm"), (9, "int4_bf16"),
                                                  (17, "int4"), (20, "linear")]),
                          int8g=Route.from_points([(1, "int8g"), (3, "int8g_bf16"), (7, "linear")]),
                          measured=FORMATS)
    backend = CpuKernelBackend(CpuKernelConfig(dispatch=table))
    for rows in range(1, 40):
        limits = backend.stack_limits(rows)
        bf16 = table.bf16.kernel(rows)
        assert project_choice(limits, rows, "bf16", True) == ("packed" if bf16 in PACKED else bf16)
        assert project_choice(limits, rows, "int8", True) == table.int8.kernel(rows)
        assert project_choice(limits, rows, "int4", False) == table.int4.kernel(rows)
        assert project_choice(limits, rows, "int8g", False) == table.int8g.kernel(rows)
        # a weight without the packed copy: the GEMV up to max_gemv_rows, as linear_float falls back
        expected = "gemv" if bf16 == "gemv" or (bf16 in PACKED and rows <= 5) else "linear"
        assert project_choice(limits, rows, "bf16", False) == expected


def test_the_backend_runs_the_tables_kernels(kernel_calls):
    require_kernels()
    table = dataclasses.replace(CpuKernelBackend().dispatch, bf16=Route.from_points([(1, "gemv"), (3, "linear")]),
                                measured=("bf16",))
    backend = CpuKernelBackend(CpuKernelConfig(dispatch=table))
    assert backend.packing is None and not backend.tiled and backend.kernels()[0] == "gemv"
    w = backend.prepare_linear((torch.randn(32, 64) * 0.1).to(torch.bfloat16), None, None)
    assert w.packed is None  # no kernel of the table reads a packed copy
    for rows in (1, 2, 3, 7):
        backend.linear(torch.randn(rows, 64).to(torch.bfloat16), w)
    assert kernel_calls.rows("linear_bf16") == [1, 2]
    assert backend.describe()["dispatch"] == table.describe()  # what /status and the start-up line show
    for missing in (e for e in ENGINES if e not in cpu_ext.matrix_engines()):
        with pytest.raises(ValueError, match="do not run here"):
            CpuKernelBackend(CpuKernelConfig(dispatch=dataclasses.replace(table, bf16=Route.only(missing))))


# ---- exactness of every kernel a table here may name ---------------------------------------------------------


def forced(fmt: str, kernel: str) -> CpuKernelBackend:
    base = CpuKernelBackend().dispatch
    return CpuKernelBackend(CpuKernelConfig(dispatch=dataclasses.replace(base, **{fmt: Route.only(kernel)})))


def check_bf16(backend: CpuKernelBackend, kernel: str, rows: int, gen: torch.Generator) -> None:
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    w = (torch.randn(160, 96, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(160, generator=gen).to(torch.bfloat16)
    got = backend.linear(x, backend.prepare_linear(w, bias, None))
    if kernel == "linear32":
        exact = w.double()
        assert_rounded_once(got, x.double() @ exact.T + bias.double(), x, exact, (rows, 160), sum_error=2 ** -20)
    elif kernel in ("linear", "onednn"):  # oneDNN's packed copy is F.linear to the bit
        assert torch.equal(got, F.linear(x, w, bias))
    else:  # fp32 sums rounded once
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), bias.float()), rtol=2 ** -8, atol=1e-4)


def check_int8(backend: CpuKernelBackend, kernel: str, rows: int, gen: torch.Generator) -> None:
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(70, 100, generator=gen) * 0.05)
    got = backend.linear(x, backend.prepare_linear(codes, None, scale))
    if kernel == "linear32":
        exact = codes.double() * scale.double()[:, None]
        assert_rounded_once(got, x.double() @ exact.T, x, exact, (rows, 70), sum_error=2 ** -20)
    elif kernel == "linear":
        assert torch.equal(got, TorchBackend().linear(x, weight_ops.Weight(codes, scale=scale)))
    elif kernel == "w8a8":
        ref = reference_w8a8(x, codes, scale, None)
        assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-30).all()
    else:
        torch.testing.assert_close(got.float(), reference_int8(x, codes, scale, None), rtol=2 ** -8, atol=1e-4)


def check_int4(backend: CpuKernelBackend, kernel: str, rows: int, gen: torch.Generator) -> None:
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(70, 100, generator=gen) * 0.05 + 0.01)
    got = backend.linear(x, backend.prepare_linear(packed, None, scales))
    if kernel == "linear32":
        weights = dequantised(packed, scales, 100)
        assert_rounded_once(got, x.double() @ weights.T, x, weights, (rows, 70), sum_error=2 ** -20)
    elif kernel == "linear":  # the kernel's dequantisation is torch's to the bit
        assert torch.equal(got, TorchBackend().linear(x, weight_ops.Weight(packed, scale=scales)))
    elif kernel == "w4a8":
        assert_rounded_once(got, reference_w4a8(x, packed, scales, None), x, dequantised(packed, scales, 100),
                            (rows, 70), sum_error=2 ** -20)
    else:
        weights = dequantised(packed, scales, 100)
        assert_rounded_once(got, x.double() @ weights.T, x, weights, (rows, 70), sum_error=2 ** -7)


def check_int8g(backend: CpuKernelBackend, kernel: str, rows: int, gen: torch.Generator) -> None:
    """The int8g kernel: the fp32 product with its exact weights within the sums' rounding, then rounded to bf16
    once; F.linear: torch's chunks of the weight dequantised to bf16, to the bit (linear32: as the kernel)."""
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    codes, scales = weight_ops.int8g_pack(torch.randint(-32, 32, (70, 100), generator=gen, dtype=torch.int8),
                                          *torch.rand(2, 70, 7, generator=gen) * 0.01, 100)
    got = backend.linear(x, backend.prepare_linear(codes, None, scales))
    weights = weight_ops.int8g_rows(codes, scales, slice(0, 70), 100, torch.float32).double()
    if kernel == "linear":
        assert torch.equal(got, TorchBackend().linear(x, weight_ops.Weight(codes, scale=scales)))
    else:
        assert_rounded_once(got, x.double() @ weights.T, x, weights, (rows, 70), sum_error=2 ** -20)


@pytest.mark.parametrize("fmt,kernel", [(fmt, kernel) for fmt in FORMATS for kernel in KERNELS[fmt]])
def test_every_kernel_a_table_here_may_name_is_exact_here(fmt, kernel, kernel_calls):
    """The kernels a table built on this machine may name (the candidates a measurement here times, W8A8 and W4A8
    included where asked for), each alone through the backend's dispatch at a few row counts, against its
    reference (tests/test_cpu_kernels.py, test_weight_int8.py, test_weight_int4.py)."""
    require_kernels()
    here = CpuKernelBackend(QUANTISED_ACTIVATIONS).candidates
    if kernel not in here[fmt]:
        pytest.skip(f"no table on this CPU names {kernel} for {fmt} weights")
    backend = forced(fmt, kernel)
    gen = torch.Generator().manual_seed(7)
    check = {"bf16": check_bf16, "int8": check_int8, "int4": check_int4, "int8g": check_int8g}[fmt]
    for rows in (1, 2, 3, 9, 64):
        if rows >= 2 or kernel not in PACKED:
            check(backend, kernel, rows, gen)
    ops = {"gemv": "linear_bf16", "tiles": "tiled_linear_bf16", "vectors": "tiled_linear_bf16"}
    if kernel in ops:
        assert kernel_calls.count(ops[kernel]) == (5 if kernel == "gemv" else 4)  # the kernel itself ran


# ---- the timer, the cache and the builder ---------------------------------------------------------------------

WORKLOAD = Workload(((32, 64), (64, 32)), ("bf16", "int4"), 16)


def counting_timer(calls: list):
    def timer(fmt: str, kernel: str, rows: int) -> float:
        calls.append((fmt, kernel, rows))
        return cost(fmt, kernel, rows)
    return timer


def test_the_kernel_timer_times_one_run_of_the_kernel_itself(kernel_calls):
    ticks = iter([0.0, 1.5, 10.0, 10.25])
    timer = KernelTimer(CpuKernelConfig(), Workload(((32, 64),), ("bf16",), 4), clock=lambda: next(ticks))
    assert timer("bf16", "gemv", 2) == 1.5
    assert kernel_calls.rows("linear_bf16") == [2, 2]  # one untimed run first, then the timed one
    assert timer("bf16", "gemv", 4) == 0.25  # no untimed run the second time
    assert kernel_calls.rows("linear_bf16") == [2, 2, 4]


def test_a_kernels_time_is_the_median_of_runs_taken_in_turns():
    order: list = []
    runs = {"gemv": iter([3.0, 3.0, 3.0, 3.0, 1.0, 2.0]), "linear": iter([1.5, 9.0, 1.6])}

    def timer(fmt: str, kernel: str, rows: int) -> float:
        order.append(kernel)
        return next(runs[kernel])

    table, timings = choose_table({"bf16": ("gemv", "linear")}, (1, 2), timer, shipped())
    assert order[3:] == ["gemv", "linear"] * 3  # alternated, not three of one then three of the other
    assert timings["bf16"][2] == {"gemv": 2.0, "linear": 1.6} and table.bf16.kernel(2) == "linear"
    with pytest.raises(ValueError, match="reps"):
        choose_table({"bf16": ("gemv", "linear")}, (1,), timer, shipped(), reps=0)


def test_a_kernel_far_behind_on_its_first_run_is_not_run_again_at_that_count():
    """More than PRUNE_FACTOR times the fastest first run: its one run stands for it at that count; at the next
    count, which it cannot take in less time, it does not run."""
    first = {"gemv": 1.0, "linear": PRUNE_FACTOR * 1.0 + 0.5, "onednn": PRUNE_FACTOR * 1.0}
    calls: list = []

    def timer(fmt: str, kernel: str, rows: int) -> float:
        calls.append((kernel, rows))
        return first[kernel]

    table, timings = choose_table({"bf16": ("gemv", "onednn", "linear")}, (1, 2, 4), timer, shipped())
    for rows in (2, 4):
        assert calls.count(("gemv", rows)) == REPS and calls.count(("onednn", rows)) == REPS  # within the factor
    assert calls.count(("linear", 2)) == 1 and timings["bf16"][2]["linear"] == first["linear"]
    assert ("linear", 4) not in calls and "linear" not in timings["bf16"][4]
    assert table.bf16.kernel(4) == "gemv"


def test_a_kernel_whose_time_at_fewer_rows_is_far_behind_is_not_run():
    """A kernel's slowest time at the counts before is a floor under its time here: past PRUNE_FACTOR times the
    best first run here it is not run; within it, it is, and it wins where it is fastest."""
    times = {"gemv": {1: 1.0, 2: 1.5, 4: 2.0, 8: 4.5, 16: 9.0}, "linear": {2: 5.0, 4: 5.0, 8: 5.5, 16: 6.0}}
    calls: list = []
    table, timings = choose_table({"bf16": ("gemv", "linear")}, (1, 2, 4, 8, 16), scripted(times, calls), shipped())
    # 4 rows: its 5.0 at 2 rows is past twice gemv's 2.0; 8 rows: within twice 4.5
    assert list(dict.fromkeys(rows for _, kernel, rows in calls if kernel == "linear")) == [2, 8, 16]
    assert "linear" not in timings["bf16"][4]
    assert table.bf16 == Route.from_points([(1, "gemv"), (9, "linear")])


def test_one_row_keeps_a_streaming_kernel_for_the_decode_stack():
    def timer(fmt: str, kernel: str, rows: int) -> float:
        return {"gemv": 2.0, "linear": 1.0}[kernel]  # F.linear faster alone at every row count

    table, timings = choose_table({"bf16": ("gemv", "linear")}, (1, 2), timer, shipped())
    assert set(timings["bf16"][1]) == {"gemv"} and table.bf16.kernel(1) == "gemv"
    assert table.bf16.kernel(2) == "linear"
    alone, _ = choose_table({"bf16": ("linear",)}, (1,), timer, shipped())
    assert alone.bf16.kernel(1) == "linear"  # no streaming kernel: the one there is

    def int4_timer(fmt: str, kernel: str, rows: int) -> float:
        return {"int4_gemm": 2.0, "int4_bf16": 1.0, "linear": 0.5}[kernel]

    int4, timings = choose_table({"int4": ("int4_gemm", "int4_bf16", "linear")}, (1, 2), int4_timer, shipped())
    assert set(timings["int4"][1]) == {"int4_gemm", "int4_bf16"} and int4.int4.kernel(1) == "int4_bf16"


def test_the_table_is_measured_once_and_read_back(tmp_path, caplog):
    require_kernels()
    calls: list = []
    cache = DiskCache(tmp_path)
    caplog.set_level(logging.INFO, logger=dispatch_store.__name__)
    first = measured_table(CpuKernelConfig(), WORKLOAD, cache, time_kernel=counting_timer(calls))
    timed = len(calls)
    assert timed > 0 and first.table.measured == ("bf16", "int4") and set(first.timings) == {"bf16", "int4"}
    assert "measured in" in caplog.text and dispatch_store.summary(first.table) in caplog.text
    again = measured_table(CpuKernelConfig(), WORKLOAD, cache, time_kernel=counting_timer(calls))
    assert len(calls) == timed and again == first  # read back, nothing timed
    assert "reused from" in caplog.text
    measured_table(CpuKernelConfig(), WORKLOAD, cache, recalibrate=True, time_kernel=counting_timer(calls))
    assert len(calls) == 2 * timed  # --recalibrate measures afresh
    other = dataclasses.replace(WORKLOAD, shapes=((48, 64),))
    measured_table(CpuKernelConfig(), other, cache, time_kernel=counting_timer(calls))
    assert len(calls) == 3 * timed  # other shapes: another key


def test_a_head_only_format_is_timed_up_to_the_rows_of_one_head_product(tmp_path):
    """own_max_rows bounds the buckets of the formats timed on their own shapes; the layers' formats keep max_rows;
    the progress counts both groups as one measurement; the bound is part of the key."""
    require_kernels()
    calls: list = []
    heard: list = []
    workload = Workload(((32, 64),), ("bf16", "int8g"), 64, own_shapes=(("int8g", ((48, 32),)),), own_max_rows=8)
    measured = measured_table(CpuKernelConfig(), workload, DiskCache(tmp_path), time_kernel=counting_timer(calls),
                              progress=lambda done, total: heard.append((done, total)))
    assert max(rows for fmt, _, rows in calls if fmt == "int8g") == 8 and set(measured.timings["int8g"]) <= {1, 2, 4, 8}
    assert max(rows for fmt, _, rows in calls if fmt == "bf16") > 8
    total = len(row_buckets(64)) + len(row_buckets(8))
    assert heard[-1] == (total, total) and all(t == total for _, t in heard)
    assert [done for done, _ in heard] == sorted(done for done, _ in heard)
    assert workload.to_key()["own_max_rows"] == 8 and "own_max_rows" not in WORKLOAD.to_key()
    assert workload.max_rows_of("int8g") == 8 and workload.max_rows_of("bf16") == 64
    with pytest.raises(ValueError, match="own_max_rows"):
        dataclasses.replace(workload, own_max_rows=128)
    with pytest.raises(ValueError, match="own_max_rows"):
        dataclasses.replace(WORKLOAD, own_max_rows=8)


@pytest.mark.parametrize("damage", ["bytes", "json"])
def test_a_damaged_entry_is_a_miss_and_is_replaced(tmp_path, damage):
    require_kernels()
    calls: list = []
    cache = DiskCache(tmp_path)
    first = measured_table(CpuKernelConfig(), WORKLOAD, cache, time_kernel=counting_timer(calls))
    (entry,) = (tmp_path / dispatch_store.KIND).glob("*.entry")
    if damage == "bytes":
        data = bytearray(entry.read_bytes())
        data[-5] ^= 0xFF
        entry.write_bytes(bytes(data))
    else:  # a sound entry of the right key that holds no table
        import json
        header = json.loads(entry.read_bytes().split(b"\n", 1)[0])
        cache.put_json(dispatch_store.KIND, header["key"], {"table": {"bf16": "nonsense"}, "timings": {}})
    timed = len(calls)
    again = measured_table(CpuKernelConfig(), WORKLOAD, cache, time_kernel=counting_timer(calls))
    assert len(calls) == 2 * timed and again.table == first.table  # measured again
    assert measured_table(CpuKernelConfig(), WORKLOAD, cache, time_kernel=counting_timer(calls)) == again
    assert len(calls) == 2 * timed  # and stored again
    with pytest.raises(ValueError, match="shipped"):
        Measured.from_wire({"table": CpuKernelBackend().dispatch.to_wire(), "timings": {}, "seconds": 1.0})


def test_the_builder_measures_the_models_shapes_and_reports_progress(tiny_model_dir, tmp_path, monkeypatch):
    require_kernels()
    calls: list = []
    monkeypatch.setattr(dispatch_store, "KernelTimer", lambda config, workload: counting_timer(calls))
    heard: list = []
    options = dict(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16, max_num_batched_tokens=64,
                   cache_dir=str(tmp_path))
    engine = build_engine_core(EngineConfig(**options), progress=lambda *report: heard.append(report))
    backend = engine.runner.backend
    assert backend.dispatch.source == "measured" and calls
    assert heard.count((MEASURING_KERNELS, 0, 7)) == 1 and (MEASURING_KERNELS, 7, 7) in heard  # 1..64 rows, bf16
    timed, buckets = {rows for _, _, rows in calls}, row_buckets(64)
    assert timed == set(buckets[:len(timed)]) and {fmt for fmt, _, _ in calls} == {"bf16"}  # 1 up, while 2+ kernels
    lone = set(buckets) - timed  # serve: all of them with AVX-512's packed kernels; AVX2 alone drops gemv by 64
    assert len(timed) >= 5 and all(backend.dispatch.route("bf16").kernel(rows) == "linear" for rows in lone)
    workload = kernel_workload(engine.runner.model, 64)
    cfg = engine.runner.model.cfg
    assert (cfg.intermediate_size, cfg.hidden_size) in workload.shapes and workload.formats == ("bf16",)
    assert backend.describe()["dispatch"]["source"] == "measured: bf16"
    assert backend.describe()["dispatch"]["int8"].endswith("(shipped)")
    timed = len(calls)
    build_engine_core(EngineConfig(**options))
    assert len(calls) == timed  # the second engine reads the first one's table
    shipped_engine = build_engine_core(EngineConfig(**options, kernel_dispatch="shipped"))
    assert shipped_engine.runner.backend.dispatch.source == "shipped" and len(calls) == timed


def test_the_timer_runs_a_format_on_its_own_shapes():
    """int8g timed on its own [48, 32] (inputs of K 32) while bf16 takes the layers' [32, 64]: mixing them up would
    fail the product's shape check."""
    require_kernels()
    workload = Workload(((32, 64),), ("bf16", "int8g"), 4, own_shapes=(("int8g", ((48, 32),)),))
    timer = KernelTimer(CpuKernelConfig(), workload)
    assert timer("bf16", "gemv", 2) > 0 and timer("int8g", "int8g", 2) > 0 and timer("bf16", "gemv", 2) > 0
    with pytest.raises(ValueError, match="own shapes"):
        Workload(((32, 64),), ("bf16",), 4, own_shapes=(("int8g", ((48, 32),)),))


def test_a_format_only_the_head_has_is_timed_on_the_heads_shape(tmp_path):
    """A GGUF of Q4_0 layers and a Q8_0 head (SmolLM2's mix): `auto` holds int4 layers and an int8g head, and the
    measurement times int8g on the head's [V, H] alone, int4 on the layers' shapes; where the head shares its
    layers' format it adds no shape."""
    import gguf

    from engine.model.loader import load_model, resolve_model
    from tests import test_gguf_quants as mixed

    q = gguf.GGMLQuantizationType
    types = {"token_embd.weight": q.Q8_0, "output.weight": q.Q8_0,
             **{f"blk.{i}.{part}.weight": q.Q4_0 for i in range(mixed.LAYERS) for part in mixed.SHAPES}}
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, types)
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    workload = kernel_workload(model, 32)
    assert workload.formats == ("int4", "int8g")
    assert workload.shapes_of("int8g") == ((model.cfg.vocab_size, model.cfg.hidden_size),)
    assert workload.shapes_of("int4") == workload.shapes and (model.cfg.vocab_size, model.cfg.hidden_size) not in \
        workload.shapes
    assert workload.to_key()["own_shapes"] == {"int8g": [[model.cfg.vocab_size, model.cfg.hidden_size]]}
    assert kernel_workload(model, 32, head_rows=8).max_rows_of("int8g") == 8
    assert kernel_workload(model, 32, head_rows=320).max_rows_of("int8g") == 32  # never past the step's rows
    int4_everywhere = load_model(resolve_model(path), torch.bfloat16, weight_dtype="int4")
    same = kernel_workload(int4_everywhere, 32, head_rows=8)
    assert same.formats == ("int4",) and same.own_shapes == () and "own_shapes" not in same.to_key()
    assert same.own_max_rows is None


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_linear_in_fp32_is_the_exact_weights_product_rounded_once(fmt):
    """The table's "linear32" multiplies in fp32 by the weight widened or dequantised exactly: within one bf16
    rounding of the float64 product (fp32 sums), where the bf16 F.linear rounds a dequantised weight first. /status
    names it; the shipped table names it where this CPU lacks bf16 dot products."""
    require_kernels()
    torch.manual_seed(11)
    n, k = 48, 96
    w = torch.randn(n, k) * 0.05
    if fmt == "bf16":
        data, scale, exact = w.to(torch.bfloat16), None, w.to(torch.bfloat16).double()
    elif fmt == "int8":
        scale = w.abs().amax(dim=1) / 127
        data = torch.round(w / scale[:, None]).to(torch.int8)
        exact = data.double() * scale.double()[:, None]
    else:
        data, scale = int4_weight(w)
        exact = dequantised(data, scale, k)
    bias = torch.randn(n).to(torch.bfloat16)
    table = dataclasses.replace(CpuKernelBackend(CpuKernelConfig(linear_fp32=False)).dispatch,
                                **{fmt: Route.only("linear32")})
    backend = CpuKernelBackend(CpuKernelConfig(dispatch=table))
    assert "linear_fp32" in backend.kernels()
    weight = backend.prepare_linear(data, bias, scale)
    x = torch.randn(5, k).to(torch.bfloat16)
    got = backend.linear(x, weight)
    ref = x.double() @ exact.T + bias.double()
    assert_rounded_once(got, ref, x, exact, (5, n), sum_error=2 ** -20)
    shipped = CpuKernelBackend().dispatch
    assert shipped.route(fmt).uses("linear32") == (not native_bf16(cpu_ext.key().features))
