"""Iteration-level scheduling: which tokens of which sequences run in the next forward pass.

Every step spends a token budget: running sequences first (decode tokens before prefill chunks), then new
or preempted sequences from the waiting queue. When the KV pool runs dry the lowest-priority running
sequence is preempted by recompute: its blocks are freed and it re-enters the waiting queue keeping its
sampled tokens, so it later resumes exactly where it stopped (often from the prefix cache).

Speculative decoding: a speculating sequence's decode step reserves budget and blocks for K draft tokens
after its last token (a verification chunk of 1 + K tokens); the engine's speculator returns the step with
the drafts added (Speculator.add_drafts), and that is the step the runner runs and update() reads.
After verification the sequence keeps the accepted drafts plus the target's own next token; the KV slots of
rejected drafts are simply overwritten later, blocks beyond the sequence's length are freed, and only blocks
whose tokens are final are registered in the prefix cache.

Adaptive compression (--kv-compress): with a compactor, a running sequence that cannot get its blocks first
has old pages of running sequences compressed into the FP4 region (engine/kv/compaction.py); only when that
cannot cover the shortfall is anyone preempted. The step's output lists the moves for the runner. Admission
never compresses: doing so only moved the shortage onto the running sequences, which were then preempted
(tiny model, 16 prompts, 64 blocks: 6 preemptions against none); the hot blocks that compaction frees as
running sequences grow are what admits newcomers.

KV-cache groups (engine/kv/groups.py): a sequence holds one block table per group, grown together. After
every step, a windowed group gives back the blocks that lie wholly before the window of the sequence's
next query (num_computed_tokens): no later query is older, since verification only ever rolls back to
positions after it, so rejected drafts never need them. A prefix-cache hit takes the longest prefix that
every group can serve: a full group needs all its blocks, a windowed one only those inside the window of
the first position it computes.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockPool, block_hash, prefix_block_hashes
from engine.kv.compaction import Compactor, Move
from engine.kv.groups import NULL_BLOCK, first_needed_block
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculative.adaptive import SpecCounters, adapt
from engine.step import RunnerOutput, ScheduledChunk, SchedulerOutput, SequenceUpdate, build_chunk, eos_for

log = logging.getLogger(__name__)
DEBUG_EVERY_STEPS = 100  # at --log-level debug, one step in this many logs its decisions (never one per token)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool = True


@dataclass
class _Plan:
    """The step being planned: which sequences run how many tokens, and what happened to make room. The
    chunks are built from it once planning is done, so each carries its sequence's final block table (a
    later compaction in the same step may still rewrite the tables of sequences planned before it)."""

    runs: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, tokens, draft slots)
    preempted_seq_ids: list[int] = field(default_factory=list)
    compressions: list[Move] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits, eos_token_ids: tuple[int, ...],
                 compactor: Compactor | None = None, windows: tuple[int | None, ...] = (None,)) -> None:
        """`windows`: per KV-cache group, the window past which its blocks are given back (None: kept)."""
        if len(windows) != pool.num_groups or len({w for w in windows if w is not None}) > 1:
            raise ValueError(f"windows {windows} must name the pool's {pool.num_groups} groups and one window")
        self.pool = pool
        self.windows = windows
        self.window = next((w for w in windows if w is not None), None)
        self.compactor = compactor
        self.limits = limits
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._running_by_id: dict[int, Sequence] = {}
        self.by_request: dict[str, list[Sequence]] = {}
        self._finished_since_step: list[int] = []
        self._remote: dict[str, tuple[list[int], list[int]]] = {}  # request -> (cached blocks, their hashes)
        self.num_preemptions = 0
        self.spec_counters = SpecCounters()
        self.num_steps = 0

    # ------------------------------------------------------------------ queue management

    def add(self, seqs: list[Sequence]) -> None:
        self.by_request.setdefault(seqs[0].request_id, []).extend(seqs)
        self.waiting.extend(seqs)

    def abort(self, request_id: str, sample_index: int | None = None) -> list[SequenceUpdate]:
        """Finish the request's unfinished sequences (or just one sample of it) now and free their blocks."""
        updates = []
        for seq in list(self.by_request.get(request_id, [])):
            if not seq.is_finished and sample_index in (None, seq.sample_index):
                self._finish(seq, FinishReason.ABORT)
                updates.append(_update(seq, None))
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_tokens(self, seq_id: int) -> list[int] | None:
        """The tokens of a running sequence (live; do not modify), for drafters."""
        seq = self._live(seq_id)
        return None if seq is None else seq.token_ids

    @property
    def finished_since_step(self) -> tuple[int, ...]:
        return tuple(self._finished_since_step)

    # ------------------------------------------------------------------ KV computed by another actor

    def reserve_remote(self, request_id: str, token_ids: list[int], deadline: float) -> tuple[list[int], int]:
        """Blocks for a prompt whose KV a prefill actor will write: the cached prefix (referenced now) then
        freshly reserved blocks. Returns (block table, number of prompt tokens already cached)."""
        if request_id in self._remote or request_id in self.by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.windows != (None,):
            raise ValueError("KV hand-off needs the plain KV layout: this engine gives windowed blocks back "
                             "(free_window_kv)")
        bs = self.pool.block_size
        hashes = prefix_block_hashes(token_ids[: len(token_ids) - 1], bs)
        cached = self.pool.find_cached_prefix(hashes)
        self.pool.acquire(cached)
        try:
            fresh = self.pool.reserve(request_id, -(-len(token_ids) // bs) - len(cached), deadline)
        except Exception:
            self.pool.free(reversed(cached))
            raise
        self._remote[request_id] = (cached, hashes[: len(cached)])
        return cached + fresh, len(cached) * bs

    def remote_fresh_blocks(self, request_id: str) -> list[int]:
        """The reserved (not cached) blocks a peer writes for this request."""
        return self.pool.reserved_blocks(request_id) if request_id in self._remote else []

    def cancel_remote(self, request_id: str) -> bool:
        """Release a reservation whose KV will not arrive (peer died, deadline passed, request aborted)."""
        cached, _ = self._remote.pop(request_id, ([], []))
        self.pool.free(reversed(cached))
        return self.pool.cancel_reservation(request_id) or bool(cached)

    def expire_remote(self, now: float) -> list[str]:
        expired = self.pool.expire_reservations(now)
        for rid in expired:
            self.cancel_remote(rid)
        return expired

    def admit_prefilled(self, seq: Sequence, first_token: int, logprobs: TokenLogprobs | None) -> SequenceUpdate:
        """The prompt's KV has arrived in the reserved blocks: the sequence starts decoding at once."""
        cached, hashes = self._remote.pop(seq.request_id)
        seq.block_tables = [cached + self.pool.commit_reservation(seq.request_id)]
        seq.block_hashes = list(hashes)
        seq.num_cached_tokens = len(cached) * self.pool.block_size
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.by_request.setdefault(seq.request_id, []).append(seq)
        self.running.append(seq)
        self._running_by_id[seq.seq_id] = seq
        self._register_full_blocks(seq)
        return self._append_token(seq, first_token, logprobs)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        plan = _Plan()
        budget = self._schedule_running(plan, self.limits.max_num_batched_tokens)
        if not plan.preempted_seq_ids:
            self._admit_waiting(plan, budget)
        finished, self._finished_since_step = tuple(self._finished_since_step), []
        self.num_steps += 1
        if self.num_steps % DEBUG_EVERY_STEPS == 1 and log.isEnabledFor(logging.DEBUG):
            self._log_decisions(plan)
        return SchedulerOutput(chunks=tuple(self._chunk(seq, n, slots) for seq, n, slots in plan.runs),
                               finished_seq_ids=finished, preempted_seq_ids=tuple(plan.preempted_seq_ids),
                               compressions=tuple(plan.compressions))

    def _log_decisions(self, plan: _Plan) -> None:
        decodes = [(n, slots) for seq, n, slots in plan.runs if seq.in_decode]
        prefill_tokens = sum(n for _, n, _ in plan.runs) - len(decodes)
        budget_left = self.limits.max_num_batched_tokens - sum(n + slots for _, n, slots in plan.runs)
        decisions = {"step": self.num_steps, "running": len(self.running), "waiting": len(self.waiting),
                     "decode_seqs": len(decodes), "draft_slots": sum(slots for _, slots in decodes),
                     "prefill_chunks": len(plan.runs) - len(decodes), "prefill_tokens": prefill_tokens,
                     "budget_left": budget_left, "preempted": len(plan.preempted_seq_ids),
                     "compressions": len(plan.compressions), "free_blocks": self.pool.num_free}
        log.debug("scheduler step %(step)d (one in %(every)d logged): %(decode_seqs)d decoding, "
                  "%(prefill_tokens)d prefill tokens in %(prefill_chunks)d chunks, %(waiting)d waiting, "
                  "%(preempted)d preempted", decisions | {"every": DEBUG_EVERY_STEPS}, extra={"scheduler": decisions})

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[SequenceUpdate]:
        updates = []
        for chunk in sched.chunks:
            seq = self._live(chunk.seq_id)
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
        self._register_full_blocks(seq)
        self._release_outside_window(seq)
        if not chunk.sample:
            return []
        update = self._append_token(seq, result.sampled_token_ids[chunk.seq_id], result.logprobs.get(chunk.seq_id))
        if chunk.num_spec_slots and not seq.is_finished:
            self._trim_blocks(seq)  # room was made for drafts that never came
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
        self._register_full_blocks(seq)
        self._trim_blocks(seq)
        self._release_outside_window(seq)
        return updates

    # ------------------------------------------------------------------ running sequences

    def _schedule_running(self, plan: _Plan, budget: int) -> int:
        # Decodes first (one token each), then continuing prefills; the queue's tail is the preemption victim.
        queue = deque(sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.sort_key)))
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = self._num_tokens_to_run(seq, budget)
            if num_new == 0:
                continue
            slots = self._spec_slots(seq, budget - num_new)
            if not self._grow_or_preempt(seq, num_new + slots, queue, plan):
                continue
            plan.runs.append((seq, num_new, slots))
            budget -= num_new + slots
        return budget

    def _spec_slots(self, seq: Sequence, budget: int) -> int:
        """Draft tokens to verify after a decode token: the sequence's K, within the budget, the free blocks and
        its length limit; under min_tokens only while every verified position bans the same stop ids."""
        if seq.spec is None or not seq.in_decode:
            return 0
        k = min(seq.spec.k, budget, seq.max_total_tokens - seq.num_tokens - 1)
        if seq.num_output_tokens < seq.params.min_tokens:
            k = min(k, seq.params.min_tokens - seq.num_output_tokens - 1)
        if k > 0 and not self.pool.can_allocate(self._blocks_needed(seq, 1 + k)):
            return 0  # speculation never preempts anyone
        return max(k, 0)

    def _grow_or_preempt(self, seq: Sequence, num_new: int, queue: deque, plan: _Plan) -> bool:
        """Give `seq` blocks for `num_new` more tokens, preempting from the queue's tail; False if seq itself went."""
        needed = self._blocks_needed(seq, num_new)
        while not self.pool.can_allocate(needed) and not self._compact(needed, plan):
            victim = queue.pop() if queue else seq
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self._grow(seq, needed)
        return True

    def _grow(self, seq: Sequence, needed: int) -> None:
        """Extend every group's table by its share of `needed` blocks (which the pool can give)."""
        for group, table in enumerate(seq.block_tables):
            table.extend(self.pool.allocate(needed // len(self.windows), group))

    def _compact(self, needed: int, plan: _Plan) -> bool:
        """Compress old pages of running sequences until `needed` blocks can be allocated; False if it cannot."""
        if self.compactor is None:
            return False
        plan.compressions += self.compactor.make_room(needed, self.running)
        return self.pool.can_allocate(needed)

    def _preempt(self, seq: Sequence, plan: _Plan) -> None:
        self._release_blocks(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._set_waiting(seq)
        plan.preempted_seq_ids.append(seq.seq_id)

    # ------------------------------------------------------------------ waiting sequences

    def _admit_waiting(self, plan: _Plan, budget: int) -> None:
        for seq in sorted(self.waiting, key=lambda s: s.sort_key):
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                return
            if not seq.ready_to_admit():
                continue
            if not self._admit(seq, budget):
                return  # head-of-line: later arrivals do not overtake one that does not fit
            num_new = self._num_tokens_to_run(seq, budget)
            plan.runs.append((seq, num_new, 0))
            budget -= num_new

    def _admit(self, seq: Sequence, budget: int) -> bool:
        self._attach_cached_prefix(seq)
        num_new = self._num_tokens_to_run(seq, budget)
        needed = self._blocks_needed(seq, num_new)
        if num_new == 0 or not self.pool.can_allocate(needed):
            self._release_blocks(seq)
            return False
        self._grow(seq, needed)
        self.waiting.remove(seq)
        self.running.append(seq)
        self._running_by_id[seq.seq_id] = seq
        seq.status = SequenceStatus.RUNNING
        return True

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        # At least one token must run to produce logits, so the last token is never taken from the cache.
        bs = self.pool.block_size
        hashes = prefix_block_hashes(seq.token_ids[: seq.num_tokens - 1], bs)
        found = [self.pool.lookup(hashes, group) for group in range(len(self.windows))]
        hit = self._cached_prefix_length(found, len(hashes))
        self.pool.record_prefix_query(len(hashes), hit)
        seq.released_blocks = 0 if self.window is None else first_needed_block(hit * bs, self.window, bs)
        seq.block_tables = [self._attach_group(seq, group, blocks[:hit]) for group, blocks in enumerate(found)]
        seq.block_hashes = hashes[:hit]
        seq.num_computed_tokens = hit * bs
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _cached_prefix_length(self, found: list[list[int | None]], longest: int) -> int:
        """The most leading blocks every group can serve (each group's lookups in `found`): each group in turn
        shortens the hit, until a whole round leaves it as it is (a windowed group's needs move with it)."""
        hit, previous = longest, None
        while hit != previous:
            previous = hit
            for blocks, window in zip(found, self.windows):  # a full group first, where there is one
                hit = self._group_hit(blocks, hit, window)
        return hit

    def _group_hit(self, blocks: list[int | None], longest: int, window: int | None) -> int:
        """The longest hit <= `longest` this group serves: every block before it (full), or those in the window
        of its first uncached position (windowed)."""
        if window is None:
            return blocks.index(None) if None in blocks[:longest] else longest
        bs = self.pool.block_size
        for hit in range(longest, 0, -1):
            if None not in blocks[first_needed_block(hit * bs, window, bs):hit]:
                return hit
        return 0

    def _attach_group(self, seq: Sequence, group: int, blocks: list[int | None]) -> list[int]:
        """Acquire the hit's blocks that `group` reads; the windowed ones it no longer needs stay NULL."""
        first = seq.released_blocks if self.windows[group] is not None else 0
        self.pool.acquire(blocks[first:], group)
        return [NULL_BLOCK] * first + blocks[first:]

    # ------------------------------------------------------------------ helpers

    def _num_tokens_to_run(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed
        if self.limits.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """Pool blocks for `num_new` more tokens: as many per group (the tables grow together)."""
        total = seq.num_computed_tokens + num_new
        return len(self.windows) * max(0, -(-total // self.pool.block_size) - len(seq.block_ids))

    def _chunk(self, seq: Sequence, num_new: int, spec_slots: int) -> ScheduledChunk:
        return build_chunk(seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new, seq.block_ids, seq.params,
                           seq.sample_index, seq.num_prompt_tokens, self.eos_token_ids,
                           speculative=seq.spec is not None and seq.in_decode, num_spec_slots=spec_slots,
                           extra_tables=seq.block_tables[1:])

    def _eos_for(self, params: SamplingParams) -> frozenset[int]:
        return eos_for(params, self.eos_token_ids)

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.pool.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))
            for table in seq.block_tables:
                if table[i] != NULL_BLOCK:
                    self.pool.register(table[i], seq.block_hashes[-1])

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> SequenceUpdate:
        seq.token_ids.append(token)
        reason = self._finish_reason(seq, token)
        if reason:
            self._finish(seq, reason)
        return _update(seq, token, logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.params.stop_token_ids or token in self._eos_for(seq.params):
            return FinishReason.STOP
        if seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release_blocks(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            del self._running_by_id[seq.seq_id]
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._finished_since_step.append(seq.seq_id)
        siblings = self.by_request.get(seq.request_id, [])
        if all(s.is_finished for s in siblings):
            self.by_request.pop(seq.request_id, None)

    def _set_waiting(self, seq: Sequence) -> None:
        self.running.remove(seq)
        del self._running_by_id[seq.seq_id]
        self.waiting.append(seq)
        seq.status = SequenceStatus.WAITING

    def _trim_blocks(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens (they held only rejected or never-filled drafts)."""
        keep = -(-seq.num_tokens // self.pool.block_size)
        for table in seq.block_tables:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(reversed(extra))

    def _release_outside_window(self, seq: Sequence) -> None:
        """Give back the windowed groups' blocks that no query from num_computed_tokens on reads."""
        if self.window is None:
            return
        first = first_needed_block(seq.num_computed_tokens, self.window, self.pool.block_size)
        if first <= seq.released_blocks:
            return
        for table, window in zip(seq.block_tables, self.windows):
            if window is not None:
                released = table[seq.released_blocks:first]
                table[seq.released_blocks:first] = [NULL_BLOCK] * len(released)
                self.pool.free(reversed(released))
        seq.released_blocks = first

    def _release_blocks(self, seq: Sequence) -> None:
        for table in seq.block_tables:  # tail first, so the shared prefix is evicted last
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_tables = [[] for _ in self.windows]
        seq.block_hashes, seq.num_computed_tokens, seq.released_blocks = [], 0, 0

    def _live(self, seq_id: int) -> Sequence | None:
        seq = self._running_by_id.get(seq_id)
        return seq if seq is not None and seq.status is SequenceStatus.RUNNING else None


def _num_accepted(chunk: ScheduledChunk, result: RunnerOutput) -> int:
    tokens = result.verified_token_ids.get(chunk.seq_id)
    return 0 if tokens is None else len(tokens) - 1


def _update(seq: Sequence, token: int | None, logprobs: TokenLogprobs | None = None) -> SequenceUpdate:
    spec = seq.spec_counts if seq.is_finished and seq.spec is not None else None
    reason = None if seq.finish_reason is None else seq.finish_reason.value
    return SequenceUpdate(seq.request_id, seq.sample_index, token, reason, logprobs,
                          seq.num_prompt_tokens, seq.num_cached_tokens, spec)
