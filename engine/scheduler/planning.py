"""Planning one step: the running sequences first, preempting when the pool runs dry, then admissions from the
waiting queue. Each part adds (sequence, tokens, draft slots) runs to the step's plan."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import PrefillShares
from engine.kv.block_pool import BlockPool
from engine.kv.compaction import Compactor, Move
from engine.scheduler.blocks import SequenceBlocks
from engine.scheduler.queues import SequenceQueues
from engine.scheduler.shares import is_long
from engine.core.sequence import Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    """A step's budget (max_num_batched_tokens) and how runs spend it. In a step shared with other work (`weighted`),
    with chunked prefill and an `attention_span` (ModelConfig.attention_span), a prompt token costs 1 plus its
    attention over its context in the same units (context / attention_span), so a chunk deep in a long prompt
    takes fewer tokens and the step costs about what a step of fresh tokens costs: the decodes and short prompts
    beside it wait no longer. A prompt alone takes whole budgets, its fastest. A decode token costs 1. With an
    `itl_target` (seconds), a step carrying decodes spends only the budget its measured costs fit in that time
    (engine/scheduler/step_times.py)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool = True
    shares: PrefillShares = PrefillShares()
    attention_span: int | None = None
    itl_target: float | None = None

    def is_long(self, seq: Sequence) -> bool:
        return is_long(seq, self.max_num_batched_tokens)

    def chunk_cost(self, context: int, tokens: int, weighted: bool = True) -> int:
        """Budget that `tokens` prompt tokens after `context` computed ones spend."""
        if not weighted or self.attention_span is None or not self.enable_chunked_prefill or tokens <= 0:
            return max(tokens, 0)
        return tokens + (tokens * (2 * context + tokens - 1)) // (2 * self.attention_span)

    def run_cost(self, seq: Sequence, tokens: int, weighted: bool = True) -> int:
        """Budget of a run of `tokens` new tokens of `seq` (a decode's token costs 1)."""
        return tokens if seq.in_decode else self.chunk_cost(seq.num_computed_tokens, tokens, weighted)

    def chunk_tokens(self, context: int, budget: int, weighted: bool = True) -> int:
        """The most prompt tokens after `context` computed ones that `budget` pays for."""
        low, high = 0, max(budget, 0)  # a token costs at least 1
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.chunk_cost(context, mid, weighted) <= budget else (low, mid - 1)
        return low


@dataclass
class StepPlan:
    """The step being planned: which sequences run how many tokens, and what happened to make room. The
    chunks are built from it once planning is done, so each carries its sequence's final block table (a
    later compaction in the same step may still rewrite the tables of sequences planned before it)."""

    runs: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, tokens, draft slots)
    preempted_seq_ids: list[int] = field(default_factory=list)
    compressions: list[Move] = field(default_factory=list)
    held_back: list[int] = field(default_factory=list)  # indexes into runs: long prefills cut by the reserve
    weighted: bool = True  # other work shares the step: prompt tokens cost their attention too (SchedulerLimits)
    in_flight: Sequence | None = None  # a long prefill whose chunk runs layer by layer: no run of this step

    def partial_prefills(self) -> list[Sequence]:
        """The planned prefills that this step leaves unfinished, and the one in flight."""
        partial = [seq for seq, n, _ in self.runs if not seq.prefill_done and n < seq.num_uncomputed]
        return partial + ([self.in_flight] if self.in_flight is not None else [])


def tokens_to_run(seq: Sequence, budget: int, limits: SchedulerLimits, weighted: bool = True) -> int:
    """Of the sequence's uncomputed tokens, as many as the budget takes (all or none without chunked prefill)."""
    remaining = seq.num_uncomputed
    if not limits.enable_chunked_prefill:
        return remaining if remaining <= budget else 0
    if seq.in_decode:
        return min(remaining, budget)
    paid = limits.chunk_tokens(seq.num_computed_tokens, budget, weighted)
    return min(remaining, paid if paid or budget <= 0 else 1)  # a token deeper than a whole budget still runs


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

    def plan(self, plan: StepPlan, budget: int, short_demand: int) -> int:
        """Adds the running sequences' runs to `plan`; returns the budget left. A long prefill leaves the share
        of the budget that `short_demand` (tokens of short prompts ready to start) is due (shares.py)."""
        # Decodes first (one token each), then continuing prefills; the queue's tail is the preemption victim.
        queue = deque(sorted((s for s in self.queues.running if s is not plan.in_flight),
                             key=lambda s: (s.num_uncomputed > 1, s.sort_key)))
        short = {s for s in queue if not s.in_decode and not self.limits.is_long(s)}
        reserve = None  # held for short prompts, running or waiting; set at the first prefill, after the decodes
        while queue and budget > 0:
            seq = queue.popleft()
            if reserve is None and not seq.in_decode:
                reserve = self.limits.shares.reserve(budget, short_demand + sum(s.num_uncomputed for s in short))
            held = (reserve or 0) if self.limits.is_long(seq) else 0
            num_new = tokens_to_run(seq, budget - held, self.limits, plan.weighted)
            if num_new == 0:
                continue
            cost = self.limits.run_cost(seq, num_new, plan.weighted)
            slots = self._spec_slots(seq, budget - cost)
            if not self._grow_or_preempt(seq, num_new + slots, queue, plan):
                continue
            if held and num_new < seq.num_uncomputed:
                plan.held_back.append(len(plan.runs))
            if reserve and seq in short:
                reserve = max(0, reserve - cost)  # a short prefill spends the share held for it
            plan.runs.append((seq, num_new, slots))
            budget -= cost + slots
        return budget

    def extend(self, plan: StepPlan, budget: int) -> None:
        """Give the long prefills held back for short prompts what those left of the budget (never preempting)."""
        for index in plan.held_back:
            seq, num_new, slots = plan.runs[index]
            context = seq.num_computed_tokens + num_new
            extra = min(seq.num_uncomputed - num_new, self.limits.chunk_tokens(context, budget, plan.weighted))
            needed = self.blocks.needed(seq, num_new + extra)  # beyond the blocks `plan` already gave it
            if extra <= 0 or not self.pool.can_allocate(needed):
                continue
            self.blocks.grow(seq, needed)
            plan.runs[index] = (seq, num_new + extra, slots)
            budget -= self.limits.chunk_cost(context, extra, plan.weighted)

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

    def short_demand(self) -> int:
        """Prompt tokens of the short sequences that would start now, for the share held back for them."""
        seats = self.limits.max_num_seqs - len(self.queues.running)
        ready = [seq for seq in self._in_order() if not self.limits.is_long(seq)][:max(seats, 0)]
        return sum(seq.num_uncomputed for seq in ready)

    def plan(self, plan: StepPlan, budget: int) -> int:
        """Adds the admitted sequences' runs to `plan`; returns the budget left."""
        partial = plan.partial_prefills()
        for seq in self._in_order():
            if budget <= 0 or len(self.queues.running) >= self.limits.max_num_seqs:
                break
            if not self._may_start_partial(seq, budget, partial, plan.weighted):
                continue  # waits for a partial prefill to finish; a short one behind it may start
            if not self._admit(seq, budget, plan.weighted):
                break  # head-of-line: later arrivals do not overtake one that does not fit
            num_new = tokens_to_run(seq, budget, self.limits, plan.weighted)
            plan.runs.append((seq, num_new, 0))
            budget -= self.limits.run_cost(seq, num_new, plan.weighted)
            if num_new < seq.num_uncomputed:
                partial.append(seq)
        return budget

    def _in_order(self) -> list[Sequence]:
        return [seq for seq in sorted(self.queues.waiting, key=lambda s: s.sort_key) if seq.ready_to_admit()]

    def _may_start_partial(self, seq: Sequence, budget: int, partial: list[Sequence], weighted: bool) -> bool:
        """Whether `seq` may start now: it finishes in this step, or the caps on unfinished prefills allow it."""
        if self.limits.run_cost(seq, seq.num_uncomputed, weighted) <= budget:
            return True
        shares = self.limits.shares
        longs = sum(1 for s in partial if self.limits.is_long(s))
        return len(partial) < shares.max_partial_prefills and \
            (not self.limits.is_long(seq) or longs < shares.max_long_partial_prefills)

    def _admit(self, seq: Sequence, budget: int, weighted: bool) -> bool:
        self.blocks.attach_cached_prefix(seq)
        num_new = tokens_to_run(seq, budget, self.limits, weighted)
        needed = self.blocks.needed(seq, num_new)
        if num_new == 0 or not self.pool.can_allocate(needed):
            self.blocks.release(seq)
            return False
        self.blocks.grow(seq, needed)
        self.queues.start(seq)
        return True
