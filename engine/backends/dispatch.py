"""Which kernel serves each product of the CPU kernel backend: per weight format (bf16, int8, int4, int8g) and row
count.

A `Route` maps a product's row count to one kernel; a `DispatchTable` holds one route per format, and the backend
looks its products up there (engine/backends/cpu_kernels.py). A format's route comes either from CpuKernelConfig's
constants (shipped) or from a measurement on the machine that runs it (`measured` names those formats;
engine/backends/dispatch_store.py): `choose_table` times each candidate kernel at each row bucket through a timer it
is given (engine/backends/kernel_timing.py times the real kernels; tests pass fakes) and keeps the fastest.

The kernels, by format (each format also has `linear32`: F.linear in fp32 on the weight widened or dequantised to
fp32, exactly the file's values, rounded once to bf16; on a CPU without bf16 dot products torch's bf16 products take
a slow path, and this one can be several times faster):
- bf16: `gemv` (cpu_ext.linear_bf16, each weight row streamed once), `tiles` / `vectors` (the weight's packed blocks
  on AMX tiles / AVX-512 BF16 vectors), `onednn` (oneDNN's packed copy), `linear` (F.linear on the plain weight).
- int8: `w8a8` (activations quantised to int8, VNNI sums), `int8` (codes widened to fp32 in registers), `linear`
  (the weight dequantised to bf16 for F.linear).
- int4: `w4a8` (activations quantised to int8, VNNI sums), `int4` (weight-only, nibbles widened in registers),
  `int4_gemm` (int4's sums on AVX-512, each group widened once per 8 rows), `int4_bf16` (weight-only on AVX-512 BF16
  dot products: the codes, exact in bf16, widened once per call), `linear` (dequantised to bf16 in chunks for
  F.linear).
- int8g: `int8g` (weight-only, the codes widened in registers against fp32 activations), `int8g_bf16` (weight-only
  on AVX-512 BF16 dot products: up to 8 rows widened in registers, more once per call, as int4_bf16), `linear`.
Pure: no torch, no timing.
"""
from __future__ import annotations

import dataclasses
import statistics
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

FORMATS = ("bf16", "int8", "int4", "int8g")
FALLBACKS = ("linear", "linear32")  # F.linear on the whole weight: serves every row count of every format
KERNELS: Mapping[str, tuple[str, ...]] = {"bf16": ("gemv", "tiles", "vectors", "onednn") + FALLBACKS,
                                          "int8": ("w8a8", "int8") + FALLBACKS,
                                          "int4": ("w4a8", "int4", "int4_gemm", "int4_bf16") + FALLBACKS,
                                          "int8g": ("int8g", "int8g_bf16") + FALLBACKS}
ENGINES = ("tiles", "vectors")  # the packed blocks' engines, as cpu_ext.matrix_engines names them
PACKED = frozenset({"tiles", "vectors", "onednn"})  # on a packed copy of the weight: 2+ rows (one row: not these)
_AVX512 = ("avx512f", "avx512bw", "avx512vl")
# The ISA features (engine/kernels/extension_build.py FEATURES) each kernel's vector code needs. gemv, int8 and
# the FALLBACKS run everywhere: their loops fall back to what the compiler makes of them for -march=native. The others'
# scalar fallbacks exist for tests only, and oneDNN refuses bf16 weights without AVX-512.
NEEDS: Mapping[str, tuple[str, ...]] = {
    "gemv": (), "linear": (), "linear32": (), "int8": (), "int8g": (),
    "tiles": ("amx-tile", "amx-bf16", "avx512bf16", "avx512bw"), "vectors": ("avx512bf16", "avx512bw"),
    "onednn": ("avx512f",), "w8a8": _AVX512 + ("avx512vnni",), "w4a8": _AVX512 + ("avx512vnni",),
    "int4": ("avx2", "fma", "f16c"), "int4_gemm": _AVX512,
    "int4_bf16": _AVX512 + ("avx512bf16",), "int8g_bf16": _AVX512 + ("avx512bf16",)}
# A row-streaming kernel (one pass over the weight per few rows) only loses ground to a GEMM as rows grow: once it
# takes this many times the time of the best kernel that may serve the next row count, larger row counts do not
# time it (the factor leaves room for a noisy median). Its time doubles with the rows, so each bucket it is timed
# at past its last win costs as much as all the ones before.
STREAMING = frozenset({"gemv", "int8", "w8a8", "int4", "w4a8", "int8g", "int4_gemm"})
# The kernels a one-row product may take: the streaming ones, and int4_bf16, which widens one or two rows' codes in
# registers (a third faster than int4_gemm at one row) and which the decode stack runs at one row too.
ONE_ROW = STREAMING | {"int4_bf16"}
PRUNE_FACTOR = 2.0
REPS = 3  # timed runs of each kernel at each row count, alternated between the kernels: their median is its time

TimeKernel = Callable[[str, str, int], float]  # (format, kernel, rows) -> seconds of one run of the product set
Timings = dict[str, dict[int, dict[str, float]]]  # format -> rows -> kernel -> seconds


def valid_kernels(features: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Per format, the kernels whose vector code a build for `features` has (KERNELS' order)."""
    have = set(features)
    return {fmt: tuple(k for k in kernels if set(NEEDS[k]) <= have) for fmt, kernels in KERNELS.items()}


def native_bf16(features: Iterable[str]) -> bool:
    """Whether a CPU of `features` has bf16 dot products (AVX-512 BF16 or AMX), which torch's bf16 products need to
    run at its fp32 products' pace."""
    return bool({"avx512bf16", "amx-bf16"} & set(features))


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_rows: the row counts a measurement times."""
    if max_rows < 1:
        raise ValueError(f"row buckets need max_rows >= 1, not {max_rows}")
    return tuple(1 << i for i in range((max_rows - 1).bit_length() + 1))


@dataclass(frozen=True)
class Route:
    """kernels[i] serves the row counts up to bounds[i] (past bounds[i - 1]); the last kernel every count past
    bounds[-1]."""

    bounds: tuple[int, ...]
    kernels: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.kernels) != len(self.bounds) + 1:
            raise ValueError(f"a route needs one kernel more than bounds, not {self.kernels} for {self.bounds}")
        if any(b < 1 for b in self.bounds) or any(a >= b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"a route's bounds must rise from 1, not {self.bounds}")
        if any(a == b for a, b in zip(self.kernels, self.kernels[1:])):
            raise ValueError(f"a route names each span's kernel once: {self.kernels}")

    @classmethod
    def only(cls, kernel: str) -> Route:
        """`kernel` for every row count (a packed kernel from 2 rows, F.linear for one)."""
        return cls.from_points([(1, "linear"), (2, kernel)] if kernel in PACKED else [(1, kernel)])

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, str]]) -> Route:
        """From (first row count, kernel) pairs, rising from 1: each kernel serves up to the next pair's row."""
        if not points or points[0][0] != 1:
            raise ValueError(f"a route's points start at row 1, not {points}")
        bounds, kernels = [], [points[0][1]]
        for first, kernel in points[1:]:
            if kernel != kernels[-1]:
                bounds.append(first - 1)
                kernels.append(kernel)
        return cls(tuple(bounds), tuple(kernels))

    @classmethod
    def from_rule(cls, rule: Callable[[int], str], limits: Iterable[int]) -> Route:
        """The route of `rule(rows)`, a choice by thresholds that changes only just past one of `limits`."""
        rows = sorted({1, 2} | {r for limit in limits if limit >= 1 for r in (limit, limit + 1)})
        return cls.from_points([(r, rule(r)) for r in rows])

    def kernel(self, rows: int) -> str:
        return self.kernels[bisect_left(self.bounds, rows)]

    def uses(self, kernel: str) -> bool:
        return kernel in self.kernels

    def last_row(self, kernel: str) -> int:
        """The most rows `kernel` serves (0: none; a huge count: every count past the last bound)."""
        if kernel not in self.kernels:
            return 0
        i = len(self.kernels) - 1 - self.kernels[::-1].index(kernel)
        return self.bounds[i] if i < len(self.bounds) else 1 << 62

    def describe(self) -> str:
        """'1: gemv, 2-128: onednn, 129+: linear'."""
        firsts = (1,) + tuple(b + 1 for b in self.bounds)
        spans = [f"{first}-{last}" if last > first else f"{first}"
                 for first, last in zip(firsts, self.bounds)] + [f"{firsts[-1]}+"]
        return ", ".join(f"{span}: {kernel}" for span, kernel in zip(spans, self.kernels))

    def to_wire(self) -> dict[str, list]:
        return {"bounds": list(self.bounds), "kernels": list(self.kernels)}

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> Route:
        bounds, kernels = raw["bounds"], raw["kernels"]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds) or \
                not all(isinstance(k, str) for k in kernels):
            raise TypeError(f"a route holds int bounds and kernel names, not {raw!r}")
        return cls(tuple(bounds), tuple(kernels))


@dataclass(frozen=True)
class DispatchTable:
    """One route per weight format; `measured` names the formats whose route was timed on this machine (the others
    come from CpuKernelConfig's constants: shipped)."""

    bf16: Route
    int8: Route
    int4: Route
    int8g: Route = Route((64,), ("int8g", "linear"))  # CpuKernelConfig's shipped limit, for tables made without one
    measured: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for fmt in FORMATS:
            route = self.route(fmt)
            unknown = [k for k in route.kernels if k not in KERNELS[fmt]]
            if unknown:
                raise ValueError(f"the {fmt} route names {unknown}: its kernels are {KERNELS[fmt]}")
            if route.kernel(1) in PACKED:
                raise ValueError(f"the {fmt} route gives one row to {route.kernel(1)}, a packed copy's kernel "
                                 "(2+ rows)")
        if len(PACKED & set(self.bf16.kernels)) > 1:
            raise ValueError(f"the bf16 route names two packings ({self.bf16.kernels}): a weight has one copy")
        if any(fmt not in FORMATS for fmt in self.measured):
            raise ValueError(f"a dispatch table's measured formats are among {FORMATS}, not {self.measured}")

    @property
    def source(self) -> str:
        """"measured" where any format's route was timed here, else "shipped"."""
        return "measured" if self.measured else "shipped"

    def route(self, fmt: str) -> Route:
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, not {fmt!r}")
        return getattr(self, fmt)

    def packing(self) -> str | None:
        """The bf16 weights' packed copy: an engine's blocks, oneDNN's, or None (no kernel reads one)."""
        return next((k for k in self.bf16.kernels if k in PACKED), None)

    def kernels(self) -> dict[str, tuple[str, ...]]:
        return {fmt: self.route(fmt).kernels for fmt in FORMATS}

    def describe(self) -> dict[str, str]:
        """{"source": "measured: bf16, int4", "bf16": "1: gemv, 2-64: onednn, 65+: linear", ...}: a shipped route
        where others were measured says so."""
        def origin(fmt: str) -> str:
            return " (shipped)" if self.measured and fmt not in self.measured else ""
        source = f"measured: {', '.join(self.measured)}" if self.measured else "shipped"
        return {"source": source, **{fmt: self.route(fmt).describe() + origin(fmt) for fmt in FORMATS}}

    def to_wire(self) -> dict[str, Any]:
        return {"measured": list(self.measured), **{fmt: self.route(fmt).to_wire() for fmt in FORMATS}}

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> DispatchTable:
        """The table to_wire wrote; KeyError, TypeError or ValueError for anything else."""
        measured = raw["measured"]
        if not isinstance(measured, list) or not all(isinstance(f, str) for f in measured):
            raise TypeError(f"a table's measured formats are a list of names, not {measured!r}")
        return cls(**{fmt: Route.from_wire(raw[fmt]) for fmt in FORMATS if fmt in raw or fmt != "int8g"},
                   measured=tuple(measured))


def choose_table(candidates: Mapping[str, Sequence[str]], buckets: Sequence[int], time_kernel: TimeKernel,
                 base: DispatchTable, row_caps: Mapping[str, int] | None = None,
                 progress: Callable[[int, int], None] | None = None, reps: int = REPS) -> tuple[DispatchTable, Timings]:
    """The measured table: for each format in `candidates`, each candidate kernel timed at each row bucket (a
    packed kernel from 2 rows, a kernel in `row_caps` up to its cap, a STREAMING one until it falls PRUNE_FACTOR
    behind; `reps` runs, the kernels alternated, the median kept), the fastest kept per bucket, serving the row
    counts up to it past the bucket before. From the first bucket of 2+ rows that only one kernel may serve, that
    kernel serves every larger count untimed. Formats not in `candidates` keep `base`'s routes. `progress(done,
    total)` hears each (format, bucket). Returns the table and the medians of the buckets timed."""
    if not buckets or buckets[0] != 1 or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"row buckets must rise from 1, not {buckets}")
    if reps < 1:
        raise ValueError(f"a measurement needs reps >= 1, not {reps}")
    caps, timings, routes = row_caps or {}, {}, {}
    total, done = len(candidates) * len(buckets), 0
    if progress is not None:
        progress(0, total)
    for fmt, kernels in candidates.items():
        _check_candidates(fmt, kernels)
        live, timings[fmt], winners = list(kernels), {}, []
        for i, rows in enumerate(buckets):
            timed = _one_row_streams([k for k in live if (rows >= 2 or k not in PACKED) and rows <= caps.get(k, rows)],
                                     rows)
            if len(timed) == 1 and rows >= 2:  # a lone kernel serves this count and every larger one: nothing to time
                winners += timed * (len(buckets) - i)
                done += len(buckets) - i
            else:
                times = _medians(fmt, timed, rows, time_kernel, reps, _slowest(timings[fmt]))
                timings[fmt][rows] = times
                winners.append(min(times, key=times.get))
                live = _unpruned(live, times, buckets[i + 1] if i + 1 < len(buckets) else None, caps)
                done += 1
            if progress is not None:
                progress(done, total)
            if len(winners) == len(buckets):
                break
        routes[fmt] = _route(buckets, winners, timings[fmt])
    measured = tuple(f for f in FORMATS if f in routes or f in base.measured)
    return dataclasses.replace(base, **routes, measured=measured), timings


def _one_row_streams(kernels: list[str], rows: int) -> list[str]:
    """At one row only the ONE_ROW kernels, where there is one: a one-row step is a batch-1 decode, which the C++
    decode stack serves only on them, and a product timed alone does not see what the stack saves (F.linear at one
    row slowed batch-1 decode of the default model end to end on an Ice Lake Xeon: the commit body has the figures)."""
    streams = [k for k in kernels if k in ONE_ROW]
    return streams if rows == 1 and streams else kernels


def _medians(fmt: str, kernels: Sequence[str], rows: int, time_kernel: TimeKernel, reps: int,
             floors: Mapping[str, float]) -> dict[str, float]:
    """Each kernel's median of `reps` runs, the kernels taking turns (a burst of load slows all of them alike). A
    kernel whose first run took PRUNE_FACTOR times the fastest first run is not run again at this count: its one
    run stands for it (on an 8B shape `linear`, which dequantises every weight a call, took a third of a
    measurement at the small counts it never wins). More rows never take less time: a kernel whose time at a
    smaller count (its floor, `floors`) was PRUNE_FACTOR times a first run here is not run at all (the F.linears
    of a 49152-row LM head, a fifth of a second a call however few the rows, took half of a measurement)."""
    samples: dict[str, list[float]] = {}
    for kernel in kernels:
        best = min((runs[0] for runs in samples.values()), default=float("inf"))
        if floors.get(kernel, 0.0) <= PRUNE_FACTOR * best:
            samples[kernel] = [time_kernel(fmt, kernel, rows)]
    best = min(runs[0] for runs in samples.values())
    close = [k for k in kernels if k in samples and samples[k][0] <= PRUNE_FACTOR * best]
    for _ in range(reps - 1):
        for kernel in close:
            samples[kernel].append(time_kernel(fmt, kernel, rows))
    return {k: statistics.median(runs) for k, runs in samples.items()}


def _slowest(timed: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """Each kernel's largest time over the buckets timed so far: a floor under its time at any larger count."""
    floors: dict[str, float] = {}
    for times in timed.values():
        for kernel, seconds in times.items():
            floors[kernel] = max(floors.get(kernel, 0.0), seconds)
    return floors


def _check_candidates(fmt: str, kernels: Sequence[str]) -> None:
    unknown = [k for k in kernels if k not in KERNELS.get(fmt, ())]
    if fmt not in KERNELS or unknown or not set(FALLBACKS) & set(kernels):
        raise ValueError(f"{fmt} candidates must be among {KERNELS.get(fmt)} and include one of {FALLBACKS}, "
                         f"not {kernels}")


def _unpruned(live: list[str], times: Mapping[str, float], next_rows: int | None,
              caps: Mapping[str, int]) -> list[str]:
    """The kernels to time at the next bucket: a STREAMING one drops out once it is PRUNE_FACTOR behind the best
    kernel that may serve the next bucket (one capped below it cannot, however fast it was here)."""
    if next_rows is None:
        return live
    serving = [t for k, t in times.items() if next_rows <= caps.get(k, next_rows)]
    best = min(serving, default=min(times.values()))
    return [k for k in live if k not in STREAMING or times.get(k, 0.0) <= PRUNE_FACTOR * best]


def _route(buckets: Sequence[int], winners: list[str], times: Mapping[int, Mapping[str, float]]) -> Route:
    """The fastest kernel per bucket (`winners`), with one packing: the packed kernel that wins most buckets
    (KERNELS' order breaks a tie) keeps them, the buckets another one won go to the fastest of the rest."""
    packings = [k for k in KERNELS["bf16"] if k in PACKED and k in winners]
    if len(packings) > 1:
        kept = max(packings, key=winners.count)
        winners = [w if w not in PACKED or w == kept else
                   min((k for k in times[b] if k not in PACKED or k == kept), key=times[b].get)
                   for w, b in zip(winners, buckets)]
    firsts = (1,) + tuple(b + 1 for b in buckets[:-1])
    return Route.from_points(list(zip(firsts, winners)))
