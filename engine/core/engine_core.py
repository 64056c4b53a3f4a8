"""One engine: model, KV pool, scheduler and runner. Token ids in, sampled token ids out.

This is what an actor runs. Text (tokenisation, detokenisation, stop strings) lives in the front end. Build one
with engine.core.builder.build_engine_core (config in, engine out).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.kv.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.kv.tiers import CLOSE_SECONDS
from engine.model.loader import ModelSource
from engine.core.runner import ModelRunner
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.speculative.adaptive import SpecState
from engine.speculative.speculator import Speculator
from engine.core.stats import EngineStats
from engine.sampling.structured import GrammarCompiler, source_compiler
from engine.core.constraints import compile_constraint, is_compiled
from engine.core.errors import RequestError
from engine.core.step import SequenceUpdate
from engine.core.treatment import Treatment


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    treatment: Treatment = Treatment()
    # A stream resumed on this engine after its first one died or drained (router.failover): sample index ->
    # the tokens it already emitted. Only those samples run; each recomputes prompt + its tokens, then goes on.
    resume: dict[int, list[int]] | None = None

    @property
    def context_token_ids(self) -> list[int]:
        """What a prefill computes: the prompt, then (resumed, n = 1) the tokens already emitted."""
        if not self.resume:
            return self.prompt_token_ids
        return self.prompt_token_ids + list(self.resume.get(0, ()))

    @property
    def num_context_tokens(self) -> int:
        return len(self.prompt_token_ids) + max(map(len, (self.resume or {}).values()), default=0)


class EngineCore:
    """Steps the scheduler, the runner and the speculator it is given (engine/core/builder.py assembles them)."""

    def __init__(self, config: EngineConfig, source: ModelSource, *, dtype: torch.dtype, max_model_len: int,
                 kv_cache: KVCache, pool: BlockPool, scheduler: Scheduler, runner: ModelRunner,
                 speculator: Speculator | None) -> None:
        self.config = config
        self.source = source
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.pool = pool
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator
        self._seq_ids = itertools.count()

    def grammar_compiler(self) -> GrammarCompiler:
        """This model's grammar compiler (built on first use; shared with the front end in this process)."""
        return source_compiler(self.source)

    def prepare_request(self, req: EngineRequest) -> None:
        """Work to do before add_request, on any thread but the step thread: compile the request's constraint,
        so that adding it costs the running streams nothing. RequestError if it cannot compile."""
        if req.params.guide is not None:
            compile_constraint(self.source, req.params.guide)

    def _compression_stats(self) -> dict[str, int]:
        compactor = self.scheduler.compactor
        if compactor is None:
            return {}
        return dict(kv_blocks_compressed=compactor.pool.num_compressed,
                    kv_blocks_cold_total=compactor.pool.cold.num_blocks, kv_compressions=compactor.num_compressed_total)

    def _tier_stats(self) -> dict[str, int]:
        tiers = self.scheduler.tiers
        return {} if tiers is None else tiers.stats()

    def close(self) -> None:
        """Let go of what outlives a step: the KV tiers get every block the pool still caches (so the disk tier
        keeps what this engine computed), then their writer stops. The engine takes no more steps."""
        tiers = self.scheduler.tiers
        if tiers is None:
            return
        for block_id, block_hash, depth in self.pool.prefix.named():
            tiers.write_back(block_id, block_hash, depth, wait=CLOSE_SECONDS)
        tiers.close()

    def add_request(self, req: EngineRequest) -> None:
        self._validate(req)
        seqs = self._sequences(req)
        for sibling in seqs[1:]:
            sibling.wait_for = seqs[0]
        self.scheduler.add(seqs)

    def _sequences(self, req: EngineRequest) -> list[Sequence]:
        max_total = self.max_model_len
        if req.params.max_tokens is not None:
            max_total = min(max_total, len(req.prompt_token_ids) + req.params.max_tokens)
        emitted = req.resume if req.resume is not None else {i: [] for i in range(req.params.n)}
        return [Sequence(next(self._seq_ids), req.request_id, i, req.prompt_token_ids + list(emitted[i]),
                         len(req.prompt_token_ids), req.params, max_total, req.priority,
                         req.arrival_time or time.monotonic(), spec=self._spec_state(req),
                         compress_first=req.treatment.compress_first, long_prompt=req.treatment.long_prompt)
                for i in sorted(emitted)]

    def _spec_state(self, req: EngineRequest) -> SpecState | None:
        """Requests speculate by the engine's default unless they say otherwise; never without a proposer."""
        if self.speculator is None or req.treatment.speculate is False:
            return None
        return SpecState.start(self.config.num_speculative_tokens)

    def _validate_resume(self, req: EngineRequest, vocab: int) -> None:
        if not req.resume or any(not 0 <= i < req.params.n for i in req.resume):
            raise RequestError("a resumed request names no sample, or one outside n", "resume")
        if req.num_context_tokens >= self.max_model_len:
            raise RequestError("a resumed request has no room left in the context", "resume")
        if any(not 0 <= t < vocab for tokens in req.resume.values() for t in tokens):
            raise RequestError("a resumed request holds token ids outside the vocabulary", "resume")

    def _validate(self, req: EngineRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; this model's context is {self.max_model_len} tokens "
                               "including at least one output token", "prompt")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise RequestError(f"the prompt has {n} tokens, more than max_num_batched_tokens "
                               f"({self.config.max_num_batched_tokens}) without chunked prefill", "prompt")
        vocab = self.source.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise RequestError("the prompt holds token ids outside the vocabulary", "prompt")
        if req.resume is not None:
            self._validate_resume(req, vocab)
        outside = [t for t, _ in req.params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias names token id {outside[0]}, outside this model's vocabulary of "
                               f"{vocab}", "logit_bias")
        if req.params.guide is not None and not is_compiled(self.source, req.params.guide):
            self.prepare_request(req)  # its caller did not: compiled here, on the step's thread
        if req.request_id in self.scheduler.by_request:
            raise RequestError(f"request id {req.request_id!r} is already in use", "request_id")

    def abort_request(self, request_id: str, sample_index: int | None = None) -> list[SequenceUpdate]:
        self.scheduler.remote.cancel(request_id)
        updates = self.scheduler.abort(request_id, sample_index)
        if self.scheduler.pacing.in_flight is None:
            self.runner.layered = None  # its blocks went with the sequence
        return updates

    def abort_all(self) -> list[SequenceUpdate]:
        updates = []
        for request_id in list(self.scheduler.by_request):
            updates += self.abort_request(request_id)
        return updates

    # ------------------------------------------------------------------ disaggregated prefill (decode side)

    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int],
                               deadline: float) -> tuple[list[int], int]:
        """Blocks a prefill actor will write this prompt's KV into; (block table, cached prompt tokens). A
        resumed request's `prompt_token_ids` are its context (EngineRequest.context_token_ids)."""
        return self.scheduler.reserve_remote(request_id, prompt_token_ids, deadline)

    def add_prefilled_request(self, req: EngineRequest, first_token: int, logprobs=None,
                              checksum: int | None = None) -> list[SequenceUpdate]:
        """Start decoding a request whose prompt KV arrived in its reserved blocks. With a checksum, the
        blocks written by the peer are verified first: a corrupt transfer is released, never decoded."""
        self._validate(req)
        if req.params.n != 1:
            raise RequestError("disaggregated requests take n=1", "n")
        if checksum is not None and checksum != self._written_checksum(req.request_id):
            self.scheduler.remote.cancel(req.request_id)
            raise RequestError(f"the KV hand-off of {req.request_id!r} failed its checksum", "kv")
        return [self.scheduler.admit_prefilled(self._sequences(req)[0], first_token, logprobs)]

    def _written_checksum(self, request_id: str) -> int:
        return self.kv_cache.checksum(self.scheduler.remote.fresh_blocks(request_id))[1]

    def cancel_remote_prefill(self, request_id: str) -> bool:
        return self.scheduler.remote.cancel(request_id)

    def expire_remote_prefills(self, now: float) -> list[str]:
        return self.scheduler.remote.expire(now)

    def step(self) -> list[SequenceUpdate]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            sched = self.speculator.add_drafts(sched, self.scheduler.running_tokens)
        result = self.runner.run(sched)
        if sched.layered is not None:
            self.runner.start_layered(sched.layered)
        updates = self.scheduler.update(sched, result)
        self.scheduler.pacing.step_took(time.perf_counter() - start)
        if self.runner.layered is not None:
            updates += self._advance_layered(time.perf_counter() - start)
        if self.speculator is not None:
            self.speculator.report(sched, result, self.scheduler.finished_since_step)
        return updates

    def _advance_layered(self, elapsed: float) -> list[SequenceUpdate]:
        """The chunk in flight runs the layers that fit in what the step left of the ITL target."""
        count = self.scheduler.pacing.layers_to_run(self.runner.layers_left, elapsed)
        start = time.perf_counter()
        result = self.runner.advance_layered(count)
        self.scheduler.pacing.layers_took(count, time.perf_counter() - start)
        return [] if result is None else self.scheduler.finish_layered(result)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    has_work = has_unfinished_requests

    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        spec = sched.spec_counters
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting), kv_blocks_total=pool.num_blocks,
                           kv_blocks_used=pool.num_used, kv_blocks_cached=pool.num_cached,
                           prefix_queries=pool.prefix.stats.prefix_queries, prefix_hits=pool.prefix.stats.prefix_hits,
                           num_preemptions=sched.num_preemptions, spec_proposed=spec.proposed,
                           spec_accepted=spec.accepted, spec_steps=spec.steps,
                           kv_bytes_per_token=self.kv_cache.bytes_per_token, **self._compression_stats(),
                           **self._tier_stats())
