"""The scheduler: schedule() plans the next step from its parts (planning.py), update() applies what the runner
returned. The package's docstring (engine/scheduler/__init__.py) describes the policy."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.kv.block_pool import BlockPool
from engine.kv.compaction import Compactor
from engine.sampling.sampler import TokenLogprobs
from engine.scheduler.blocks import SequenceBlocks
from engine.scheduler.pacing import Pacing
from engine.scheduler.planning import Admission, RunningPlanner, SchedulerLimits, StepPlan
from engine.scheduler.queues import SequenceQueues
from engine.scheduler.remote import RemoteReservations
from engine.core.sequence import FinishReason, Sequence
from engine.speculative.adaptive import SpecCounters, adapt
from engine.core.step import (PromptResult, RunnerOutput, ScheduledChunk, SchedulerOutput, SequenceUpdate, build_chunk,
                              eos_for)

if TYPE_CHECKING:
    from engine.kv.tiers import KVTiers

log = logging.getLogger(__name__)
DEBUG_EVERY_STEPS = 100  # at --log-level debug, one step in this many logs its decisions (never one per token)


class Scheduler:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits, eos_token_ids: tuple[int, ...],
                 compactor: Compactor | None = None, windows: tuple[int | None, ...] = (None,),
                 tiers: KVTiers | None = None) -> None:
        """`windows`: per KV-cache group, the window past which its blocks are given back (None: kept). `tiers`:
        the KV tiers below the pool, whose blocks admission loads (engine/scheduler/blocks.py)."""
        if len(windows) != pool.num_groups or len({w for w in windows if w is not None}) > 1:
            raise ValueError(f"windows {windows} must name the pool's {pool.num_groups} groups and one window")
        self.pool = pool
        self.windows = windows
        self.compactor = compactor
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queues = SequenceQueues()
        self.tiers = tiers
        self.blocks = SequenceBlocks(pool, windows, tiers)
        self.remote = RemoteReservations(pool, windows)
        self.running_planner = RunningPlanner(pool, self.blocks, self.queues, limits, compactor)
        self.admission = Admission(pool, self.blocks, self.queues, limits)
        # the queues' own containers, read by the engine, the actors and the benches
        self.waiting, self.running, self.by_request = self.queues.waiting, self.queues.running, self.queues.by_request
        self.spec_counters = SpecCounters()
        self.num_steps = 0
        self.pacing = Pacing(limits, pool, self.blocks, self.queues, compactor is None and pool.num_groups == 1)

    @property
    def num_preemptions(self) -> int:
        return self.running_planner.num_preemptions

    # ------------------------------------------------------------------ queue management

    def add(self, seqs: list[Sequence]) -> None:
        self.queues.add(seqs)

    def abort(self, request_id: str, sample_index: int | None = None) -> list[SequenceUpdate]:
        """Finish the request's unfinished sequences (or just one sample of it) now and free their blocks."""
        updates = []
        for seq in list(self.by_request.get(request_id, [])):
            if not seq.is_finished and sample_index in (None, seq.sample_index):
                self.pacing.drop(seq)
                self._finish(seq, FinishReason.ABORT)
                updates.append(self._update(seq, None))
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_tokens(self, seq_id: int) -> list[int] | None:
        """The tokens of a running sequence (live; do not modify), for drafters."""
        seq = self.queues.live(seq_id)
        return None if seq is None else seq.token_ids

    @property
    def finished_since_step(self) -> tuple[int, ...]:
        return self.queues.finished_since_step

    # ------------------------------------------------------------------ KV computed by another actor

    def reserve_remote(self, request_id: str, token_ids: list[int], deadline: float) -> tuple[list[int], int]:
        """Blocks for a prompt whose KV a prefill actor will write: the cached prefix (referenced now) then
        freshly reserved blocks. Returns (block table, number of prompt tokens already cached)."""
        if request_id in self.remote or request_id in self.by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.remote.reserve(request_id, token_ids, deadline)

    def admit_prefilled(self, seq: Sequence, first_token: int, logprobs: TokenLogprobs | None) -> SequenceUpdate:
        """The prompt's KV has arrived in the reserved blocks: the sequence starts decoding at once."""
        table, hashes = self.remote.commit(seq.request_id)
        seq.block_tables, seq.block_hashes = [table], hashes
        seq.num_cached_tokens = len(hashes) * self.pool.block_size
        seq.num_computed_tokens = seq.num_tokens
        self.queues.add_running(seq)
        self.blocks.register_full(seq)
        return self._append_token(seq, first_token, logprobs)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(weighted=self._shared_step())
        layered = self.pacing.start_layered(lambda seq, n: self._chunk(seq, n, 0))
        plan.in_flight = None if self.pacing.in_flight is None else self.pacing.in_flight[0]
        budget = self.running_planner.plan(plan, self.pacing.step_budget(), self.admission.short_demand())
        if not plan.preempted_seq_ids:
            budget = self.admission.plan(plan, budget)
        self.running_planner.extend(plan, budget)
        finished = self.queues.take_finished()
        self.num_steps += 1
        self.pacing.planned(plan)
        if self.num_steps % DEBUG_EVERY_STEPS == 1 and log.isEnabledFor(logging.DEBUG):
            self._log_decisions(plan)
        return SchedulerOutput(chunks=tuple(self._chunk(seq, n, slots) for seq, n, slots in plan.runs),
                               finished_seq_ids=finished, preempted_seq_ids=tuple(plan.preempted_seq_ids),
                               compressions=tuple(plan.compressions), layered=layered)

    def finish_layered(self, result: RunnerOutput) -> list[SequenceUpdate]:
        """The chunk in flight has run its last layer: its tokens are computed (and its next token sampled where it
        ends the prompt)."""
        done = self.pacing.take_in_flight()
        if done is None or self.queues.live(done[0].seq_id) is None:
            return []
        return self._apply_chunk(*done, result)

    def _shared_step(self) -> bool:
        """Whether more than one sequence may run this step (running, or waiting and ready to start)."""
        running = len(self.queues.running)
        if running > 1:
            return True  # the usual serving step: no walk of the waiting queue
        return running + sum(1 for seq in self.queues.waiting if seq.ready_to_admit()) > 1

    def _log_decisions(self, plan: StepPlan) -> None:
        decodes = [(n, slots) for seq, n, slots in plan.runs if seq.in_decode]
        prefill_tokens = sum(n for _, n, _ in plan.runs) - len(decodes)
        budget_left = self.limits.max_num_batched_tokens - sum(self.limits.run_cost(seq, n, plan.weighted) + slots
                                                               for seq, n, slots in plan.runs)
        decisions = {"step": self.num_steps, "running": len(self.running), "waiting": len(self.waiting),
                     "decode_seqs": len(decodes), "draft_slots": sum(slots for _, slots in decodes),
                     "prefill_chunks": len(plan.runs) - len(decodes), "prefill_tokens": prefill_tokens,
                     "budget_left": budget_left, "preempted": len(plan.preempted_seq_ids),
                     "compressions": len(plan.compressions), "free_blocks": self.pool.num_free}
        log.debug("scheduler step %(step)d (one in %(every)d logged): %(decode_seqs)d decoding, "
                  "%(prefill_tokens)d prefill tokens in %(prefill_chunks)d chunks, %(waiting)d waiting, "
                  "%(preempted)d preempted", decisions | {"every": DEBUG_EVERY_STEPS}, extra={"scheduler": decisions})

    def _chunk(self, seq: Sequence, num_new: int, spec_slots: int) -> ScheduledChunk:
        return build_chunk(seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new, seq.block_ids, seq.params,
                           seq.sample_index, seq.num_prompt_tokens, self.eos_token_ids,
                           speculative=seq.spec is not None and seq.in_decode, num_spec_slots=spec_slots,
                           extra_tables=seq.block_tables[1:], prompt_pass=seq.in_prompt_pass)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[SequenceUpdate]:
        updates = []
        for chunk in sched.chunks:
            seq = self.queues.live(chunk.seq_id)
            if seq is None:
                continue
            if chunk.seq_id in result.verified_token_ids:
                updates.extend(self._apply_verified(seq, chunk, result))
            else:
                updates.extend(self._apply_chunk(seq, chunk, result))
            if chunk.speculative:
                seq.spec = adapt(seq.spec, chunk.num_draft, _num_accepted(chunk, result))
        return updates

    def _apply_chunk(self, seq: Sequence, chunk: ScheduledChunk, result: RunnerOutput) -> list[SequenceUpdate]:
        seq.num_computed_tokens += len(chunk.token_ids)
        self.blocks.register_full(seq)
        self.blocks.release_outside_window(seq)
        if not chunk.sample:
            return []
        update = self._append_token(seq, result.sampled_token_ids[chunk.seq_id], result.logprobs.get(chunk.seq_id),
                                    result.prompt_results.get(chunk.seq_id))
        if chunk.num_spec_slots and not seq.is_finished:
            self.blocks.trim(seq)  # room was made for drafts that never came
        return [update]

    def _apply_verified(self, seq: Sequence, chunk: ScheduledChunk, result: RunnerOutput) -> list[SequenceUpdate]:
        """Append the emitted tokens one by one (each may finish the sequence), then keep the KV of the last
        token and the accepted drafts only."""
        tokens = result.verified_token_ids[chunk.seq_id]
        logprobs = result.verified_logprobs.get(chunk.seq_id) or [None] * len(tokens)
        self.spec_counters.record(chunk.num_draft, len(tokens) - 1)
        seq.spec_counts = seq.spec_counts.record(chunk.num_draft, len(tokens) - 1)
        updates = []
        for token, lp in zip(tokens, logprobs):
            updates.append(self._append_token(seq, token, lp))
            if seq.is_finished:
                return updates
        seq.num_computed_tokens = chunk.start_pos + len(tokens)  # last token + accepted drafts
        self.blocks.register_full(seq)
        self.blocks.trim(seq)
        self.blocks.release_outside_window(seq)
        return updates

    # ------------------------------------------------------------------ tokens and finishing

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                      prompt: PromptResult | None = None) -> SequenceUpdate:
        seq.token_ids.append(token)
        reason = self._finish_reason(seq, token)
        if reason:
            self._finish(seq, reason)
        return self._update(seq, token, logprobs, prompt)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.params.stop_token_ids or token in eos_for(seq.params, self.eos_token_ids):
            return FinishReason.STOP
        if seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.blocks.release(seq)
        self.queues.finish(seq, reason)

    def _update(self, seq: Sequence, token: int | None, logprobs: TokenLogprobs | None = None,
                prompt: PromptResult | None = None) -> SequenceUpdate:
        spec = seq.spec_counts if seq.is_finished and seq.spec is not None else None
        reason = None if seq.finish_reason is None else seq.finish_reason.value
        return SequenceUpdate(seq.request_id, seq.sample_index, token, reason, logprobs, seq.num_prompt_tokens,
                              seq.num_cached_tokens, spec,
                              request_finished=seq.is_finished and seq.request_id not in self.by_request,
                              prompt=prompt)


def _num_accepted(chunk: ScheduledChunk, result: RunnerOutput) -> int:
    tokens = result.verified_token_ids.get(chunk.seq_id)
    return 0 if tokens is None else len(tokens) - 1

