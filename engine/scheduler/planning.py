"""Planning one step: the running sequences first, preempting when the pool runs dry, then admissions from the
waiting queue. Each part adds (sequence, tokens, draft slots) runs to the step's plan."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockPool
from engine.kv.compaction import Compactor, Move
from engine.scheduler.blocks import SequenceBlocks
from engine.scheduler.queues import SequenceQueues
from engine.core.sequence import Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool = True


@dataclass
class StepPlan:
    """The step being planned: which sequences run how many tokens, and what happened to make room. The
    chunks are built from it once planning is done, so each carries its sequence's final block table (a
    later compaction in the same step may still rewrite the tables of sequences planned before it)."""

    runs: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, tokens, draft slots)
    preempted_seq_ids: list[int] = field(default_factory=list)
    compressions: list[Move] = field(default_factory=list)


def tokens_to_run(seq: Sequence, budget: int, limits: SchedulerLimits) -> int:
    """Of the sequence's uncomputed tokens, as many as the budget takes (all or none without chunked prefill)."""
    remaining = seq.num_uncomputed
    if limits.enable_chunked_prefill:
        return min(remaining, budget)
    return remaining if remaining <= budget else 0


class RunningPlanner:
    """The running sequences' share of a step: decodes first (one token each, plus draft slots for a speculating
    sequence), then continuing prefills. Blocks come from the pool, else from compressing old pages (with a
    compactor), else by preempting the lowest-priority running sequence by recompute."""

    def __init__(self, pool: BlockPool, blocks: SequenceBlocks, queues: SequenceQueues, limits: SchedulerLimits,
                 compactor: Compactor | None) -> None:
        self.pool = pool
        self.blocks = blocks
        self.queues = queues
        self.limits = limits
        self.compactor = compactor
        self.num_preemptions = 0

    def plan(self, plan: StepPlan, budget: int) -> int:
        """Adds the running sequences' runs to `plan`; returns the budget left."""
        # Decodes first (one token each), then continuing prefills; the queue's tail is the preemption victim.
        queue = deque(sorted(self.queues.running, key=lambda s: (s.num_uncomputed > 1, s.sort_key)))
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = tokens_to_run(seq, budget, self.limits)
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
        if k > 0 and not self.pool.can_allocate(self.blocks.needed(seq, 1 + k)):
            return 0  # speculation never preempts anyone
        return max(k, 0)

    def _grow_or_preempt(self, seq: Sequence, num_new: int, queue: deque, plan: StepPlan) -> bool:
        """Give `seq` blocks for `num_new` more tokens, preempting from the queue's tail; False if seq itself went."""
        needed = self.blocks.needed(seq, num_new)
        while not self.pool.can_allocate(needed) and not self._compact(needed, plan):
            victim = queue.pop() if queue else seq
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.blocks.grow(seq, needed)
        return True

    def _compact(self, needed: int, plan: StepPlan) -> bool:
        """Compress old pages of running sequences until `needed` blocks can be allocated; False if it cannot."""
        if self.compactor is None:
            return False
        plan.compressions += self.compactor.make_room(needed, self.queues.running)
        return self.pool.can_allocate(needed)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.blocks.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.queues.set_waiting(seq)
        plan.preempted_seq_ids.append(seq.seq_id)


class Admission:
    """The waiting sequences' share of a step, in priority order, each from its longest cached prefix. Admission
    never compresses: doing so only moved the shortage onto the running sequences, which were then preempted
    (tiny model, 16 prompts, 64 blocks: 6 preemptions against none)."""

    def __init__(self, pool: BlockPool, blocks: SequenceBlocks, queues: SequenceQueues,
                 limits: SchedulerLimits) -> None:
        self.pool = pool
        self.blocks = blocks
        self.queues = queues
        self.limits = limits

    def plan(self, plan: StepPlan, budget: int) -> None:
        for seq in sorted(self.queues.waiting, key=lambda s: s.sort_key):
            if budget <= 0 or len(self.queues.running) >= self.limits.max_num_seqs:
                return
            if not seq.ready_to_admit():
                continue
            if not self._admit(seq, budget):
                return  # head-of-line: later arrivals do not overtake one that does not fit
            num_new = tokens_to_run(seq, budget, self.limits)
            plan.runs.append((seq, num_new, 0))
            budget -= num_new

    def _admit(self, seq: Sequence, budget: int) -> bool:
        self.blocks.attach_cached_prefix(seq)
        num_new = tokens_to_run(seq, budget, self.limits)
        needed = self.blocks.needed(seq, num_new)
        if num_new == 0 or not self.pool.can_allocate(needed):
            self.blocks.release(seq)
            return False
        self.blocks.grow(seq, needed)
        self.queues.start(seq)
        return True
