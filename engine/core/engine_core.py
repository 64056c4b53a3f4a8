"""One engine: model, KV pool, scheduler and runner. Token ids in, sampled token ids out.

This is what an actor runs. Text (tokenisation, detokenisation, stop strings) lives in the front end.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from engine.kv.block_pool import BlockPool, TieredBlockPool
from engine.kv.compaction import MIN_BATCH_SHARE, Compactor
from engine.config import EngineConfig
from engine.kv.cache import KVCache, choose_num_blocks, grouped_num_blocks
from engine.kv.groups import KVGroups
from engine.kv.compress import ColdRegion, split_kv_budget
from engine.model.loader import ModelSource, load_model, resolve_dtype, resolve_model
from engine.backends import select_backend
from engine.core.runner import ModelRunner
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.core.sequence import Sequence
from engine.speculative.adaptive import SpecState
from engine.speculative.build import build_proposer
from engine.speculative.proposer import Proposer
from engine.speculative.speculator import Speculator
from engine.core.stats import EngineStats
from engine.sampling.structured import GrammarCompiler, source_compiler
from engine.core.constraints import compile_constraint, is_compiled
from engine.core.errors import RequestError
from engine.core.step import SequenceUpdate


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    speculate: bool | None = None  # Treatment.speculate
    compress_first: bool = False  # Treatment.compress_first
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
    def __init__(self, config: EngineConfig, source: ModelSource | None = None, device: str = "cpu",
                 kv_allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                 proposer: Proposer | None = None) -> None:
        """`kv_allocator(shape, dtype)` provides the KV pool's memory (an actor passes shared memory).
        `proposer` replaces the one `config.speculative` would build here (a decode actor's draft actor client)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.source = source or resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype, device)
        model_cfg = self.source.config
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        model = load_model(self.source, self.dtype, device, config.weight_dtype)
        kv_format = config.kv_cache_dtype
        plain_blocks, num_cold = self._kv_block_counts()
        # An exported pool (an actor's: a peer writes its pages) and a compressed one keep the plain layout
        groups = KVGroups.for_model(model_cfg, config.free_window_kv and kv_allocator is None and not num_cold)
        num_blocks = grouped_num_blocks(model_cfg, plain_blocks, groups)
        storage = None if kv_allocator is None else kv_allocator(
            KVCache.shape_for(model_cfg, num_blocks, config.block_size, kv_format),
            KVCache.storage_dtype(self.dtype, kv_format))
        self.kv_cache = KVCache(model_cfg, num_blocks, config.block_size, self.dtype, device, storage, kv_format,
                                groups)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching, groups.num_groups) \
            if not num_cold else TieredBlockPool(num_blocks, num_cold, config.block_size, config.enable_prefix_caching)
        limits = SchedulerLimits(config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill)
        eos = self.source.tokenizer.eos_token_ids or model_cfg.eos_token_ids
        self.scheduler = Scheduler(self.pool, limits, tuple(eos), self._compactor(), groups.windows)
        self.runner = ModelRunner(model, self.kv_cache, device, select_backend(device, self.dtype, config.enforce_eager),
                                  grammar_compiler=self.grammar_compiler)
        if num_cold:
            self.runner.attach_cold_region(ColdRegion(model_cfg, num_cold, num_blocks, config.block_size,
                                                      self.dtype, device))
        if proposer is None:
            proposer = build_proposer(config, model, self.source, plain_blocks, self.dtype, device)
        self.speculator = None if proposer is None else Speculator(proposer, model_cfg.vocab_size)
        self._seq_ids = itertools.count()

    def grammar_compiler(self) -> GrammarCompiler:
        """This model's grammar compiler (built on first use; shared with the front end in this process)."""
        return source_compiler(self.source)

    def prepare_request(self, req: EngineRequest) -> None:
        """Work to do before add_request, on any thread but the step thread: compile the request's constraint,
        so that adding it costs the running streams nothing. RequestError if it cannot compile."""
        if req.params.guide is not None:
            compile_constraint(self.source, req.params.guide)

    def _kv_block_counts(self) -> tuple[int, int]:
        """(hot blocks, FP4 blocks): adaptive compression splits the KV budget, otherwise all of it is hot."""
        c, model_cfg = self.config, self.source.config
        available = psutil.virtual_memory().available
        if c.kv_compress == "none":
            return choose_num_blocks(model_cfg, c.block_size, self.dtype, c.num_kv_blocks, c.kv_cache_memory,
                                     available, c.kv_cache_dtype), 0
        return split_kv_budget(model_cfg, c.block_size, self.dtype, c.kv_cache_dtype, c.num_kv_blocks,
                               c.kv_cache_memory, available, c.kv_compress_share)

    def _compactor(self) -> Compactor | None:
        if not isinstance(self.pool, TieredBlockPool):
            return None
        return Compactor(self.pool, self.config.kv_compress_after, int(self.pool.num_blocks * MIN_BATCH_SHARE))

    def _compression_stats(self) -> dict[str, int]:
        compactor = self.scheduler.compactor
        if compactor is None:
            return {}
        return dict(kv_blocks_compressed=compactor.pool.num_compressed,
                    kv_blocks_cold_total=compactor.pool.cold.num_blocks, kv_compressions=compactor.num_compressed_total)

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
                         compress_first=req.compress_first)
                for i in sorted(emitted)]

    def _spec_state(self, req: EngineRequest) -> SpecState | None:
        """Requests speculate by the engine's default unless they say otherwise; never without a proposer."""
        if self.speculator is None or req.speculate is False:
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
        return self.scheduler.abort(request_id, sample_index)

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
        sched = self.scheduler.schedule()
        if self.speculator is not None:
            sched = self.speculator.add_drafts(sched, self.scheduler.running_tokens)
        result = self.runner.run(sched)
        updates = self.scheduler.update(sched, result)
        if self.speculator is not None:
            self.speculator.report(sched, result, self.scheduler.finished_since_step)
        return updates

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    has_work = has_unfinished_requests

    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        spec = sched.spec_counters
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting), kv_blocks_total=pool.num_blocks,
                           kv_blocks_used=pool.num_used, kv_blocks_cached=pool.num_cached,
                           prefix_queries=pool.stats.prefix_queries, prefix_hits=pool.stats.prefix_hits,
                           num_preemptions=sched.num_preemptions, spec_proposed=spec.proposed,
                           spec_accepted=spec.accepted, spec_steps=spec.steps,
                           kv_bytes_per_token=self.kv_cache.bytes_per_token, **self._compression_stats())
