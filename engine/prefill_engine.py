"""The prefill side of disaggregation: run prompts and write their KV straight into another actor's pages.

A decode actor exports its KV pool once; the prefill actor maps it and runs each prompt with that pool as
its cache and the reserved blocks as the block table, so every layer's keys and values land in place as the
layer computes them. Only the first sampled token (and the sampler's RNG state) travels back.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model.loader import ModelSource, load_model, resolve_dtype, resolve_model
from engine.runner import ModelRunner
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput, build_chunk


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


@dataclass
class PrefillResult:
    request_id: str
    destination: str
    first_token: int
    logprobs: TokenLogprobs | None
    generator_state: bytes | None
    num_cached_tokens: int  # prompt tokens that were already in the destination, so not computed here
    num_bytes: int = 0  # KV bytes written into the destination
    checksum: int = 0  # crc32 of those bytes, verified by the destination before it decodes


class PrefillEngine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None, device: str = "cpu") -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.source = source or resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, device)
        self.runner = ModelRunner(load_model(self.source, self.dtype, device), None, device,
                                  use_kernels=not config.enforce_eager)
        self.eos_token_ids = frozenset(self.source.tokenizer.eos_token_ids or self.source.config.eos_token_ids)
        self.pools: dict[str, KVCache] = {}
        self.jobs: dict[str, PrefillJob] = {}
        self._seq_ids = itertools.count()
        self._dropped_seq_ids: list[int] = []  # runner state to release at the next step

    def attach_pool(self, name: str, kv_cache: KVCache) -> None:
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
            self._dropped_seq_ids.append(job.seq_id)
        return job is not None

    def has_work(self) -> bool:
        return bool(self.jobs)

    def step(self) -> list[PrefillResult]:
        """One forward: chunks of the oldest destination's jobs, within the token budget."""
        if not self.jobs:
            return []
        destination = next(iter(self.jobs.values())).destination
        sched = self._schedule(destination)
        result = self.runner.run(sched, self.pools[destination])
        return self._update(sched, result, destination)

    def _schedule(self, destination: str) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks = []
        for job in self.jobs.values():
            if job.destination != destination or budget <= 0:
                continue
            num_new = min(len(job.token_ids) - job.num_computed, budget)
            chunks.append(build_chunk(job.seq_id, job.token_ids, job.num_computed, num_new, job.block_table,
                                      job.params, 0, len(job.token_ids), self.eos_token_ids))
            budget -= num_new
        dropped, self._dropped_seq_ids = self._dropped_seq_ids, []
        return SchedulerOutput(chunks=chunks, finished_seq_ids=dropped)

    def _update(self, sched: SchedulerOutput, result, destination: str) -> list[PrefillResult]:
        done = []
        by_seq = {job.seq_id: job for job in self.jobs.values()}
        for chunk in sched.chunks:
            job = by_seq[chunk.seq_id]
            job.num_computed += len(chunk.token_ids)
            if chunk.sample:
                del self.jobs[job.request_id]
                written = job.block_table[job.num_cached // self.pools[destination].block_size:]
                num_bytes, checksum = self.pools[destination].checksum(written)
                done.append(PrefillResult(job.request_id, destination, result.sampled_token_ids[chunk.seq_id],
                                          result.logprobs.get(chunk.seq_id),
                                          self.runner.export_generator(chunk.seq_id), job.num_cached,
                                          num_bytes, checksum))
        return done
