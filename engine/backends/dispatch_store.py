"""The dispatch table of this machine: measured once per kernel build, machine and workload, and remembered in the
disk cache (engine.disk_cache) so that every later start, and every other engine on this machine, reads it.

The key names what the measurement's answer depends on: the kernels' build key (sources, flags, ISA features,
torch's version), the processor and its core count, the workload (the model's layer shapes and weight formats, the
largest step), the row buckets, the candidate kernels and their row caps. torch's thread count is not in it: every
engine on one machine reads the same table, so every actor runs the same kernels and computes the same bits. One
process measures at a time (an flock beside the entry); the others wait and read its table. `--recalibrate`
measures afresh and replaces the entry; a damaged entry is a miss, measured again.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.dispatch import DispatchTable, TimeKernel, Timings, choose_table, row_buckets
from engine.backends.kernel_timing import KernelTimer, Workload
from engine.disk_cache import DiskCache
from engine.kernels import cpu_ext
from engine.kernels.extension_build import cpu_model

log = logging.getLogger(__name__)

KIND = "kernel-dispatch"
PROCEDURE = 4  # what a measurement does; a change makes older entries another key's


@dataclass(frozen=True)
class Measured:
    """A measured table, the times that chose it (format -> rows -> kernel -> seconds) and how long it took."""

    table: DispatchTable
    timings: Timings
    seconds: float

    def to_wire(self) -> dict[str, Any]:
        timings = {fmt: {str(rows): times for rows, times in by_rows.items()} for fmt, by_rows in self.timings.items()}
        return {"table": self.table.to_wire(), "timings": timings, "seconds": self.seconds}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> Measured:
        """KeyError, TypeError, ValueError or AttributeError for anything to_wire did not write."""
        timings = {fmt: {int(rows): {str(k): float(t) for k, t in times.items()} for rows, times in by_rows.items()}
                   for fmt, by_rows in raw["timings"].items()}
        table = DispatchTable.from_wire(raw["table"])
        if not table.measured:
            raise ValueError("a measured entry holds a shipped table")
        return cls(table, timings, float(raw["seconds"]))


def measured_table(config: CpuKernelConfig, workload: Workload, cache: DiskCache, recalibrate: bool = False,
                   progress: Callable[[int, int], None] | None = None,
                   time_kernel: TimeKernel | None = None) -> Measured:
    """This machine's table for `workload`: the remembered one for its key (unless `recalibrate`), else measured by
    `time_kernel` (default: a KernelTimer on `config`) and stored. One log line says which, with the table; a cache
    that cannot be read or written only costs the measurement. `progress(done, total)` hears each row bucket."""
    backend = CpuKernelBackend(config)
    candidates = {fmt: backend.candidates[fmt] for fmt in workload.formats}
    buckets = row_buckets(workload.max_rows)
    key = dispatch_key(candidates, workload, buckets, config.row_caps())
    with _one_measurer(cache, key):
        found = None if recalibrate else _lookup(cache, key)
        if found is not None:
            log.info("kernel dispatch: reused from %s: %s", cache.path(KIND, key), summary(found.table))
            return found
        start = time.perf_counter()
        table, timings = _choose(candidates, workload, time_kernel or KernelTimer(config, workload), backend.dispatch,
                                 config.row_caps(), progress)
        measured = Measured(table, timings, time.perf_counter() - start)
        stored = _store(cache, key, measured)
    log.info("kernel dispatch: measured in %.2f s%s, %s: %s", measured.seconds,
             " (--recalibrate)" if recalibrate else "", stored, summary(table))
    return measured


def _choose(candidates: dict[str, tuple[str, ...]], workload: Workload, time_kernel: TimeKernel,
            base: DispatchTable, caps: dict[str, int],
            progress: Callable[[int, int], None] | None) -> tuple[DispatchTable, Timings]:
    """choose_table over each format's own row buckets (Workload.max_rows_of): one measurement a row limit, each
    table the base of the next, `progress` counting over all of them."""
    groups: dict[int, dict[str, tuple[str, ...]]] = {}
    for fmt, kernels in candidates.items():
        groups.setdefault(workload.max_rows_of(fmt), {})[fmt] = kernels
    total = sum(len(group) * len(row_buckets(rows)) for rows, group in groups.items())
    table, timings, offset = base, {}, 0
    for rows, group in sorted(groups.items()):
        buckets = row_buckets(rows)
        heard = None if progress is None else functools.partial(_shifted, progress, offset, total)
        table, times = choose_table(group, buckets, time_kernel, table, caps, heard)
        timings.update(times)
        offset += len(group) * len(buckets)
    return table, timings


def _shifted(progress: Callable[[int, int], None], offset: int, total: int, done: int, _: int) -> None:
    progress(offset + done, total)


def dispatch_key(candidates: dict[str, tuple[str, ...]], workload: Workload, buckets: tuple[int, ...],
                 caps: dict[str, int]) -> dict[str, Any]:
    return {"procedure": PROCEDURE, "build": cpu_ext.key().name, "cpu": cpu_model(), "cores": os.cpu_count(),
            "workload": workload.to_key(), "buckets": list(buckets),
            "candidates": {fmt: list(kernels) for fmt, kernels in candidates.items()}, "caps": caps}


def summary(table: DispatchTable) -> str:
    """'bf16 [1-64: gemv, 65+: linear]; int8 [... (shipped)]; int4 [...] (measured: bf16, int4)': one log line."""
    routes = table.describe()
    source = routes.pop("source")
    return "; ".join(f"{fmt} [{route}]" for fmt, route in routes.items()) + f" ({source})"


@contextlib.contextmanager
def _one_measurer(cache: DiskCache, key: dict[str, Any]) -> Iterator[None]:
    """Holds the entry's lock (an flock: it ends with the process), or nothing where the cache cannot be written."""
    path = cache.path(KIND, key).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as exc:
        log.warning("kernel dispatch: no lock under %s (%s); measuring without it", cache.root, exc)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _lookup(cache: DiskCache, key: dict[str, Any]) -> Measured | None:
    raw = cache.get_json(KIND, key)
    if raw is None:
        return None
    try:
        return Measured.from_wire(raw)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        log.warning("kernel dispatch: cache entry %s holds no table (%s); measuring again", cache.path(KIND, key),
                    exc)
        return None


def _store(cache: DiskCache, key: dict[str, Any], measured: Measured) -> str:
    try:
        return f"stored in {cache.put_json(KIND, key, measured.to_wire())}"
    except OSError as exc:
        log.warning("kernel dispatch: could not store it under %s (%s); the next start measures again", cache.root,
                    exc)
        return "not stored"
