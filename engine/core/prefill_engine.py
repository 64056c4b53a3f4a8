"""The prefill side of disaggregation: run prompts and write their KV straight into another actor's pages.

A decode actor exports its KV pool once; the prefill actor maps it and runs each prompt with that pool as
its cache and the reserved blocks as the block table, so every layer's keys and values land in place as the
layer computes them. Only the first sampled token travels back (seeded sampling needs no RNG state: its
draws are keyed by position, engine.core.step.position_seed).

A decode actor on another host cannot be mapped: its jobs are *streamed*. The prompt runs into a private
pool sized to it (the destination's cached prefix is recomputed here, its KV is not on this host), and the
result carries the pages the destination lacks, per layer, for the actor to send in KVPages messages. With a
`PageSink` (a direct stream to that host, transport.kv_stream), pages go to it instead, as they become final:
by default after each layer of each chunk, the blocks that chunk completed (`--kv-stream-overlap`), so the
transfer runs behind the rest of the prefill. On a GPU each layer's pages reach host memory by a copy on a side
stream (engine.kv.staging), so neither the compute stream nor the step thread waits for them.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.kv.staging import HostStager
from engine.model.loader import ModelSource
from engine.core.runner import ModelRunner
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.sampling_params import SamplingParams
from engine.core.step import RunnerOutput, SchedulerOutput, build_chunk


class PageSink(Protocol):
    """Where a streamed job's pages go (transport.kv_stream.KVStreamSender); called on the step thread."""

    def send_pages(self, request_id: str, layer: int, block_ids: list[int], pages: torch.Tensor,
                   bytes_per_block: int, ready: Callable[[], None] | None = None) -> None:
        """`pages` are host memory, readable once `ready()` (when given) has returned."""

    def end(self, request_id: str, deadline: float, done) -> None: ...

    def cancel(self, request_id: str) -> None: ...


@dataclass
class PrefillJob:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_table: list[int]  # destination blocks covering the whole prompt
    num_computed: int  # prompt tokens already in the destination (its prefix cache)
    destination: str  # name of the attached KV pool
    deadline: float
    seq_id: int = -1
    num_cached: int = field(default=0, init=False)  # num_computed at submission: what the destination had
    stream_to: list[int] | None = None  # set by add_streamed (destination on another host): where pages go
    num_prompt_tokens: int | None = None  # of token_ids, the prompt; the rest were generated (a resumed stream)
    sink: PageSink | None = None  # set by add_streamed: pages go there as they are final, not in the result
    num_sent_blocks: int = field(default=0, init=False)  # of the private pool's blocks: sent to the sink


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    destination: str
    first_token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens that were already in the destination, so not computed here
    num_bytes: int = 0  # KV bytes written into the destination
    checksum: int = 0  # crc32 of those bytes, verified by the destination before it decodes
    pages: list[bytes] | None = None  # streamed job: each layer's pages (KVCache.read_pages) to send
    dest_block_ids: list[int] = field(default_factory=list)  # streamed job: where those pages go (as on the wire)
    sink: PageSink | None = None  # streamed job whose pages went to this sink: the actor ends its stream
    deadline: float = 0.0  # the job's (monotonic)


class PrefillEngine:
    """Runs prefill jobs into attached pools with the runner it is given (engine/core/builder.py assembles it)."""

    def __init__(self, config: EngineConfig, source: ModelSource, *, dtype: torch.dtype, device: str,
                 runner: ModelRunner) -> None:
        self.config = config
        self.source = source
        self.dtype = dtype
        self.device = device
        self.runner = runner
        self.eos_token_ids = frozenset(source.tokenizer.eos_token_ids or source.config.eos_token_ids)
        self.pools: dict[str, KVCache] = {}
        self.jobs: dict[str, PrefillJob] = {}
        self._seq_ids = itertools.count()
        self.stream_overlap = config.kv_stream_overlap  # when a streamed job's pages go to its sink
        self.stager = HostStager.for_device(device)  # how they reach host memory

    def attach_pool(self, name: str, kv_cache: KVCache) -> None:
        """Compute into `kv_cache`, another engine's pool: in the plain layout only, the one hand-off writes."""
        if not kv_cache.groups.is_plain:
            raise ValueError(f"pool {name!r} has {kv_cache.groups.num_groups} KV-cache groups; a hand-off needs "
                             "the plain layout (build that engine with free_window_kv=False)")
        self.pools[name] = kv_cache

    def detach_pool(self, name: str) -> list[str]:
        """Forget a destination (its actor died); returns the jobs that were writing into it, now dropped."""
        self.pools.pop(name, None)
        dropped = [rid for rid, job in self.jobs.items() if job.destination == name]
        for rid in dropped:
            self._drop(rid)
        return dropped

    def add(self, job: PrefillJob) -> None:
        if job.destination not in self.pools:
            raise ValueError(f"no KV pool named {job.destination!r} is attached")
        if job.request_id in self.jobs:
            raise ValueError(f"request id {job.request_id!r} is already in use")
        job.seq_id = next(self._seq_ids)
        job.num_cached = job.num_computed
        self.jobs[job.request_id] = job

    def add_streamed(self, job: PrefillJob, kv_format: str = "auto", sink: PageSink | None = None) -> None:
        """A job whose destination pool is on another host (`job.block_table` and `job.num_computed` name its
        blocks and cached prefix): compute the whole prompt into a private pool in the destination's page
        format; the pages of the blocks the destination lacks go to `sink` while it runs, or without one in
        the result."""
        bs = self.config.block_size
        name = f"stream:{job.request_id}"
        if name in self.pools or job.request_id in self.jobs:
            raise ValueError(f"request id {job.request_id!r} is already in use")
        skip = job.num_computed // bs
        num_blocks = -(-len(job.token_ids) // bs)
        if len(job.block_table) != num_blocks:
            raise ValueError(f"{len(job.block_table)} destination blocks for a {num_blocks}-block prompt")
        self.pools[name] = KVCache(self.source.config, num_blocks, bs, self.dtype, self.device, kv_format=kv_format)
        job.stream_to = job.block_table[skip:]
        job.block_table, job.num_computed, job.destination = list(range(num_blocks)), 0, name
        job.sink, job.num_sent_blocks = sink, skip
        self.add(job)
        job.num_cached = skip * bs  # what the destination had: those pages are computed here but not sent

    def abort(self, request_id: str) -> bool:
        return self._drop(request_id)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        late = [rid for rid, job in self.jobs.items() if job.deadline <= now]
        for rid in late:
            self._drop(rid)
        return late

    def _drop(self, request_id: str) -> bool:
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self.runner.forget([job.seq_id])
            if job.stream_to is not None:
                self.pools.pop(job.destination, None)
            if job.sink is not None:
                job.sink.cancel(request_id)
        return job is not None

    def has_work(self) -> bool:
        return bool(self.jobs)

    def step(self) -> list[PrefillResult]:
        """One forward: chunks of the oldest destination's jobs, within the token budget."""
        if not self.jobs:
            return []
        destination = next(iter(self.jobs.values())).destination
        sched = self._schedule(destination)
        pool = self.pools[destination]
        streams = self._streams(sched, pool)
        self.runner.model.layer_hook = (lambda layer: self._send_layer(streams, pool, layer)) if streams else None
        try:
            result = self.runner.run(sched, pool)
        finally:
            self.runner.model.layer_hook = None
        for job, _, hi in streams:
            job.num_sent_blocks = hi
        return self._update(sched, result, destination)

    def _streams(self, sched: SchedulerOutput, pool: KVCache) -> list[tuple[PrefillJob, int, int]]:
        """The sink jobs of this step with the private-pool blocks [lo, hi) that are final once it has run."""
        if self.stream_overlap == "none":
            return []
        by_seq = {job.seq_id: job for job in self.jobs.values() if job.sink is not None}
        streams = []
        for chunk in sched.chunks:
            job = by_seq.get(chunk.seq_id)
            if job is None:
                continue
            computed = job.num_computed + len(chunk.token_ids)
            last = computed >= len(job.token_ids)
            if self.stream_overlap == "layer" and not last:
                continue
            hi = len(job.block_table) if last else computed // pool.block_size
            if hi > job.num_sent_blocks:
                streams.append((job, job.num_sent_blocks, hi))
        return streams

    def _send_layer(self, streams: list[tuple[PrefillJob, int, int]], pool: KVCache, layer: int) -> None:
        for job, lo, hi in streams:
            skip = len(job.block_table) - len(job.stream_to)
            staged = self.stager.stage(pool.data[layer, :, lo:hi])
            job.sink.send_pages(job.request_id, layer, job.stream_to[lo - skip:hi - skip], staged.pages,
                                pool.bytes_per_layer_block, staged.ready)

    def _schedule(self, destination: str) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks = []
        for job in self.jobs.values():
            if job.destination != destination or budget <= 0:
                continue
            num_new = min(len(job.token_ids) - job.num_computed, budget)
            chunks.append(build_chunk(job.seq_id, job.token_ids, job.num_computed, num_new, job.block_table,
                                      job.params, 0, job.num_prompt_tokens or len(job.token_ids),
                                      self.eos_token_ids))
            budget -= num_new
        return SchedulerOutput(chunks=tuple(chunks))

    def _update(self, sched: SchedulerOutput, result: RunnerOutput, destination: str) -> list[PrefillResult]:
        done = []
        by_seq = {job.seq_id: job for job in self.jobs.values()}
        for chunk in sched.chunks:
            job = by_seq[chunk.seq_id]
            job.num_computed += len(chunk.token_ids)
            if chunk.sample:
                done.append(self._finish(job, result, destination))
        return done

    def _finish(self, job: PrefillJob, result: RunnerOutput, destination: str) -> PrefillResult:
        del self.jobs[job.request_id]
        self.runner.forget([job.seq_id])
        pool = self.pools[destination]
        written = job.block_table[job.num_cached // pool.block_size:]
        num_bytes, checksum = pool.checksum(written)
        pages = self._take_streamed_pages(job, written)
        return PrefillResult(job.request_id, destination, result.sampled_token_ids[job.seq_id],
                             result.logprobs.get(job.seq_id), job.num_cached, num_bytes, checksum, pages,
                             job.stream_to or [], sink=job.sink, deadline=job.deadline)

    def _take_streamed_pages(self, job: PrefillJob, written: list[int]) -> list[bytes] | None:
        """A streamed job's pages to send, per layer; its private pool goes with them. None for a mapped job
        and for a sink job, whose pages not sent yet go to the sink now (views: the sink holds the memory)."""
        if job.stream_to is None:
            return None
        pool = self.pools.pop(job.destination)
        if job.sink is not None:
            lo, hi = job.num_sent_blocks, len(job.block_table)
            if hi > lo:
                self._send_layers(job, pool, lo, hi)
            return None
        return [pool.read_pages(layer, written) for layer in range(pool.data.shape[0])]

    def _send_layers(self, job: PrefillJob, pool: KVCache, lo: int, hi: int) -> None:
        for layer in range(pool.data.shape[0]):
            self._send_layer([(job, lo, hi)], pool, layer)
        job.num_sent_blocks = hi
