"""Decode steps replayed as CUDA graphs.

Run eagerly, a decode step launches several kernels per layer from Python, and at small batches the GPU waits on
those launches. Captured once per batch-size bucket when the runner is built, a step is one graph replay: its
inputs are copied into static buffers (the fixed addresses the graph reads), the rows padded up to the bucket,
and its hidden states read from the graph's static output. Capture happens as the engine is built, before an
actor's start-up calibration, so that calibration measures the steps as they will be served.

Padding rows take token 0 at position 0, KV slot -1 (the backend's write_kv skips it) and context length 0
(the decode kernel gives zeros): they touch no page, and their outputs are never read.

What is captured is the model's forward, embedding to final norm, of a decode-only batch (one token a row: plain
decoding, or draft tokens verified as rows) on the engine's own unquantised pages in one KV-cache group; the LM
head and the sampler run eagerly after it (what they do varies per step: logprobs, grammars, penalties). Any
other step (prefill rows, more rows than the largest bucket, another engine's pool, compressed pages) runs
eagerly, as does every step where the plan is refused (`graph_refusal`).

The bookkeeping (buckets, padding, buffers) is plain code, tested on the CPU with `EagerCapture`, a stand-in
that replays by running the forward again on the same buffers; `CudaCapture` is torch.cuda.CUDAGraph.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import torch

from engine.backends.attention import AttentionMetadata
from engine.backends.base import Backend
from engine.kv.cache import KVCache
from engine.model.progress import CAPTURING_GRAPHS, Progress, counted

log = logging.getLogger(__name__)
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8  # above the small buckets: padding costs at most 7 rows of a large batch

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list], torch.Tensor]


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to the first size that holds `max_rows`."""
    if max_rows < 1:
        raise ValueError(f"CUDA graph buckets need at least one row, got {max_rows}")
    sizes = [s for s in SMALL_BUCKETS if s < max_rows]
    size = next((s for s in SMALL_BUCKETS if s >= max_rows), -(-max_rows // BUCKET_STEP) * BUCKET_STEP)
    sizes.extend(range(SMALL_BUCKETS[-1] + BUCKET_STEP, size, BUCKET_STEP))  # empty where size is a small one
    return tuple(sizes) + (size,)


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows`; None where none does (the step runs eagerly)."""
    return next((s for s in sizes if s >= rows), None)


@dataclass(frozen=True)
class GraphPlan:
    """What the runner captures: a graph per bucket, block tables up to `max_blocks` wide."""

    sizes: tuple[int, ...]
    max_blocks: int
    block_size: int
    capture: Literal["cuda", "eager"] = "cuda"  # eager: the CPU stand-in (tests, a dry run)


def graph_refusal(mode: str, device: torch.device | str, backend: Backend, kv_cache: KVCache | None) -> str | None:
    """Why this engine's decode steps are not captured (None: they are)."""
    if mode == "off":
        return "--cuda-graphs off"
    if torch.device(device).type != "cuda":
        return "not a CUDA device"
    if not backend.captures_decode:
        return f"backend {backend.name} ({', '.join(backend.describe().get('kernels', [])) or 'plain torch'}) " \
               "cannot be captured"
    if kv_cache is None:
        return "no KV pool of its own"
    if kv_cache.kv_format != "auto":
        return f"--kv-cache-dtype {kv_cache.kv_format} pages are re-encoded on the host side of each write"
    if kv_cache.groups.num_groups != 1:
        return "KV-cache groups (each has its own block tables)"
    return None


def graph_plan(mode: str, device: torch.device | str, backend: Backend, kv_cache: KVCache | None,
               max_num_seqs: int, max_model_len: int) -> GraphPlan | None:
    """The buckets up to max_num_seqs rows, or None with a log line saying why steps stay eager."""
    refusal = graph_refusal(mode, device, backend, kv_cache)
    if refusal is not None:
        if torch.device(device).type == "cuda":
            log.info("CUDA graphs off: %s", refusal)
        return None
    return GraphPlan(bucket_sizes(max_num_seqs), -(-max_model_len // kv_cache.block_size), kv_cache.block_size)


class StepInput(Protocol):
    """What a step's input holds that a replay reads (engine/core/runner.py ModelInput)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    group_metas: tuple[AttentionMetadata, ...]


class StaticInputs:
    """Fixed-address inputs of decode steps of up to max_rows rows."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device | str) -> None:
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_rows, **long)
        self.positions = torch.zeros(max_rows, **long)
        self.slot_mapping = torch.full((max_rows,), -1, **long)
        self.block_tables = torch.zeros(max_rows, max_blocks, **long)
        self.context_lens = torch.zeros(max_rows, **long)
        self.block_size = block_size

    def fits(self, inp: StepInput) -> bool:
        tables = inp.meta.decode_block_tables
        return tables is not None and tables.shape[1] <= self.block_tables.shape[1]

    def load(self, inp: StepInput, rows: int) -> None:
        """The step's n rows first, then rows n..rows-1 as padding."""
        n = len(inp.input_ids)
        meta = inp.meta
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.pad(n, rows)

    def pad(self, start: int, stop: int) -> None:
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = -1
        self.context_lens[start:stop] = 0

    def meta(self, rows: int) -> AttentionMetadata:
        """The metadata a captured step of `rows` rows reads: views of the buffers. Its longest context is the
        tables' width (the kernels read each row's own length)."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:rows], num_decode=rows, num_decode_seqs=rows,
                                 decode_block_tables=self.block_tables[:rows],
                                 decode_context_lens=self.context_lens[:rows],
                                 max_decode_context=self.block_tables.shape[1] * self.block_size, use_kernels=True)


class Captured(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


@dataclass
class EagerStep:
    """The CPU stand-in of a captured step: a replay runs the forward again into the same output tensor."""

    run: Callable[[], torch.Tensor]
    output: torch.Tensor

    def replay(self) -> None:
        self.output.copy_(self.run())


def eager_capture(run: Callable[[], torch.Tensor]) -> EagerStep:
    return EagerStep(run, run())


@dataclass
class CudaStep:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaCapture:
    """torch.cuda.CUDAGraph captures sharing one memory pool (the largest bucket first: the smaller ones fit
    in what it left)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pool = None

    def __call__(self, run: Callable[[], torch.Tensor]) -> CudaStep:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: Triton and torch.compile compile on a first call, never in a capture
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        self.pool = graph.pool()
        return CudaStep(graph, output)


class DecodeGraphs:
    """One captured decode step per bucket, over the buffers of `inputs`, and the counts of steps replayed (per
    bucket) and run eagerly."""

    def __init__(self, plan: GraphPlan, forward: Forward, layers: list, device: torch.device | str,
                 progress: Progress | None = None) -> None:
        """`forward(input_ids, positions, meta, layers)` -> hidden [rows, hidden]: the model's; `layers`: the
        pages captured steps read, whose steps alone replay; `progress` hears each bucket captured."""
        self.plan = plan
        self.layers = layers
        self.inputs = StaticInputs(plan.sizes[-1], plan.max_blocks, plan.block_size, device)
        capture = eager_capture if plan.capture == "eager" else CudaCapture(device)
        self.steps: dict[int, Captured] = {}
        for rows in counted(sorted(plan.sizes, reverse=True), progress, CAPTURING_GRAPHS, len(plan.sizes)):
            self.inputs.pad(0, rows)
            meta = self.inputs.meta(rows)
            ids, positions = self.inputs.input_ids[:rows], self.inputs.positions[:rows]
            self.steps[rows] = capture(lambda ids=ids, positions=positions, meta=meta: forward(ids, positions, meta,
                                                                                                layers))
        self.replays: Counter[int] = Counter()
        self.eager_steps = 0

    @staticmethod
    def capture_or_none(plan: GraphPlan, forward: Forward, layers: list, device: torch.device | str,
                        progress: Progress | None = None) -> DecodeGraphs | None:
        """The captured steps; None, with a warning, where a capture fails (every step then runs eagerly, as
        with --cuda-graphs off): a graph that cannot be made must not keep an engine from serving."""
        try:
            return DecodeGraphs(plan, forward, layers, device, progress)
        except Exception as exc:
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            return None

    def run(self, inp: StepInput, layers: list) -> torch.Tensor | None:
        """hidden [n, hidden] of a decode-only step of n rows on the captured pages, from the smallest bucket that
        holds it; None (counted) where the step must run eagerly."""
        rows = bucket_for(len(inp.input_ids), self.plan.sizes)
        if (rows is None or layers is not self.layers or inp.meta.prefills or len(inp.group_metas) != 1
                or inp.meta.num_decode != len(inp.input_ids) or not self.inputs.fits(inp)):
            self.eager_steps += 1
            return None
        self.inputs.load(inp, rows)
        step = self.steps[rows]
        step.replay()
        self.replays[rows] += 1
        return step.output[:len(inp.input_ids)]
