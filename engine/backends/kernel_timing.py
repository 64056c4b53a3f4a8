"""Times the CPU backend's product kernels on a model's own shapes: the timer a dispatch measurement runs
(dispatch.choose_table, which asks for one run at a time and keeps the median of several).

Each kernel runs as the backend runs it: a CpuKernelBackend whose table sends every row count of that format to
that kernel prepares random weights of each shape (its packed copies included) and runs `linear` on them, so the
time includes what the dispatch itself costs. The clock is injected (tests pass a fake one).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.dispatch import FORMATS, Route
from engine.backends.weight_ops import Weight, block_int8g_scales, int4_shapes, int8g_shapes


Shape = tuple[int, int]


@dataclass(frozen=True)
class Workload:
    """What a measurement times: each of `shapes` ([N, K] products, the model's distinct layer shapes) once per
    timed run, in each of `formats`, at row counts up to `max_rows` (the engine's largest step); a format named in
    `own_shapes` times those instead (a format only the LM head has: the head's own shape), up to `own_max_rows`
    rows where given (the most rows of one LM-head product)."""

    shapes: tuple[Shape, ...]
    formats: tuple[str, ...]
    max_rows: int
    own_shapes: tuple[tuple[str, tuple[Shape, ...]], ...] = ()
    own_max_rows: int | None = None

    def __post_init__(self) -> None:
        if not self.shapes or any(n < 1 or k < 1 for n, k in self.shapes):
            raise ValueError(f"a kernel workload needs [N, K] shapes of at least 1, not {self.shapes}")
        if not self.formats or any(f not in FORMATS for f in self.formats):
            raise ValueError(f"a kernel workload's formats are among {FORMATS}, not {self.formats}")
        if self.max_rows < 1:
            raise ValueError(f"a kernel workload's max_rows must be >= 1, not {self.max_rows}")
        for fmt, shapes in self.own_shapes:
            if fmt not in self.formats or not shapes or any(n < 1 or k < 1 for n, k in shapes):
                raise ValueError(f"a kernel workload's own shapes are of its formats and at least 1, not {fmt}: "
                                 f"{shapes}")
        if self.own_max_rows is not None and not (self.own_shapes and 1 <= self.own_max_rows <= self.max_rows):
            raise ValueError(f"a kernel workload's own_max_rows is for its own shapes, from 1 to max_rows "
                             f"({self.max_rows}), not {self.own_max_rows}")

    def shapes_of(self, fmt: str) -> tuple[Shape, ...]:
        return dict(self.own_shapes).get(fmt, self.shapes)

    def max_rows_of(self, fmt: str) -> int:
        own = self.own_max_rows is not None and fmt in dict(self.own_shapes)
        return self.own_max_rows if own else self.max_rows

    def to_key(self) -> dict:
        key = {"shapes": [list(s) for s in self.shapes], "formats": list(self.formats), "max_rows": self.max_rows}
        if self.own_shapes:
            key["own_shapes"] = {fmt: [list(s) for s in shapes] for fmt, shapes in self.own_shapes}
        if self.own_max_rows is not None:
            key["own_max_rows"] = self.own_max_rows
        return key


class KernelTimer:
    """timer(format, kernel, rows) -> the seconds of one run of every workload shape through `kernel`, after one
    untimed run the first time a (format, kernel) is asked for (it touches the weights and packed copies first)."""

    def __init__(self, config: CpuKernelConfig, workload: Workload, clock: Callable[[], float] = time.perf_counter,
                 seed: int = 0) -> None:
        self.config, self.workload, self.clock = config, workload, clock
        self.generator = torch.Generator().manual_seed(seed)
        self.prepared: dict[tuple[str, str], tuple[CpuKernelBackend, list[Weight]]] = {}
        self.inputs: tuple[tuple, list[torch.Tensor]] = ((), [])  # ((rows, shapes), one x a shape) of the latest call

    def __call__(self, fmt: str, kernel: str, rows: int) -> float:
        fresh = (fmt, kernel) not in self.prepared
        backend, weights = self._prepared(fmt, kernel)
        xs = self._inputs(rows, self.workload.shapes_of(fmt))
        with torch.inference_mode():
            if fresh:
                self._run(backend, weights, xs)
            start = self.clock()
            self._run(backend, weights, xs)
            return self.clock() - start

    @staticmethod
    def _run(backend: CpuKernelBackend, weights: list[Weight], xs: list[torch.Tensor]) -> None:
        for x, w in zip(xs, weights):
            backend.linear(x, w)

    def _prepared(self, fmt: str, kernel: str) -> tuple[CpuKernelBackend, list[Weight]]:
        """A backend that sends every `fmt` product to `kernel`, and the workload's weights prepared by it."""
        if (fmt, kernel) not in self.prepared:
            self.prepared = {key: v for key, v in self.prepared.items() if key[0] == fmt}  # one format's at a time
            base = CpuKernelBackend(self.config).dispatch
            table = dataclasses.replace(base, **{fmt: Route.only(kernel)})
            backend = CpuKernelBackend(dataclasses.replace(self.config, dispatch=table))
            weights = [backend.prepare_linear(*self._weight(fmt, n, k)) for n, k in self.workload.shapes_of(fmt)]
            self.prepared[(fmt, kernel)] = backend, weights
        return self.prepared[(fmt, kernel)]

    def _weight(self, fmt: str, n: int, k: int) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """Random (data, bias, scale) of an [N, K] weight in `fmt`: the values do not change a kernel's time."""
        g = self.generator
        if fmt == "bf16":
            return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16), None, None
        if fmt == "int8":
            return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None, torch.rand(n, generator=g)
        if fmt == "int8g":
            codes, scales = int8g_shapes(n, k, offsets=True)  # scales per 16, with offsets: the most a type reads
            scale = torch.rand(scales, generator=g) * 0.01
            blocked = block_int8g_scales(scale)  # as a loaded model holds them where N allows
            return torch.randint(-32, 32, codes, generator=g, dtype=torch.int8), None, \
                scale if blocked is None else blocked
        codes, scales = int4_shapes(n, k)
        return (torch.randint(0, 256, codes, generator=g, dtype=torch.uint8), None,
                (torch.rand(scales, generator=g) * 0.01).to(torch.float16))

    def _inputs(self, rows: int, shapes: tuple[Shape, ...]) -> list[torch.Tensor]:
        if self.inputs[0] != (rows, shapes):
            self.inputs = (rows, shapes), [torch.randn(rows, k, generator=self.generator).to(torch.bfloat16)
                                           for _, k in shapes]
        return self.inputs[1]
