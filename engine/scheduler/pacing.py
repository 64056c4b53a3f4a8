"""Steps paced to an inter-token latency target (SchedulerLimits.itl_target): the scheduler's part that knows
time. A decoding stream's gap between tokens is the step that made them; a long prompt beside the decodes must
not stretch it.

- A step carrying decodes spends only the token budget that its measured costs fit in the target
  (step_times.py learns a decode step and a prefill budget unit from the steps run).
- A long prompt running beside decodes does not take a cut chunk every step: it takes a whole budget's chunk, as
  it would alone, and runs it a few layers a step after each step's decodes, as many as fit in what the step
  left of the target (at least one), until its last layer; then its tokens count as computed. Cut chunks paid
  every step's fixed costs (the prefix's attention packing, small products, the step itself): a 6.5k prompt
  beside 4 streams took 13.8 s cut to 0.1 s against 9.7 s in whole chunks; layer by layer, 11.1 s, its steps
  at 84 ms median (2-core EPYC, SmolLM2-135M).
"""
from __future__ import annotations

from typing import Callable

from engine.core.sequence import Sequence
from engine.core.step import ScheduledChunk
from engine.kv.block_pool import BlockPool
from engine.scheduler.blocks import SequenceBlocks
from engine.scheduler.planning import SchedulerLimits, StepPlan, tokens_to_run
from engine.scheduler.queues import SequenceQueues
from engine.scheduler.step_times import StepTimes


class Pacing:
    def __init__(self, limits: SchedulerLimits, pool: BlockPool, blocks: SequenceBlocks, queues: SequenceQueues,
                 layered: bool) -> None:
        """`layered`: whether a long prompt's chunk may run layer by layer here (not where a compactor moves
        pages under it, nor where KV-cache groups give layers different tables)."""
        self.limits, self.pool, self.blocks, self.queues = limits, pool, blocks, queues
        self.layered = layered and limits.itl_target is not None and limits.enable_chunked_prefill
        self.times = StepTimes()
        self.in_flight: tuple[Sequence, ScheduledChunk] | None = None  # the chunk running layer by layer
        self._last_step = (0, 0)  # (decode rows, prefill budget units) of the step planned last
        self._in_flight_units = 0  # the chunk in flight's cost in budget units, as if it shared a step

    def step_budget(self) -> int:
        """The token budget, cut where decodes run to what fits in the target (decodes and draft slots take theirs
        first; a prefill beside them keeps at least step_times.MIN_UNITS)."""
        budget, target = self.limits.max_num_batched_tokens, self.limits.itl_target
        if target is None:
            return budget
        decodes = sum(1 + (seq.spec.k if seq.spec is not None else 0) for seq in self.queues.running if seq.in_decode)
        units = self.times.units_within(target) if decodes else None
        return budget if units is None else min(budget, decodes + units)

    def start_layered(self, make_chunk: Callable[[Sequence, int], ScheduledChunk]) -> ScheduledChunk | None:
        """A whole budget's chunk (unweighted, as alone) of the oldest long prefill running beside decodes, its
        blocks taken now, to run layer by layer; None where none starts (one is in flight already)."""
        if not self.layered or self.in_flight is not None or not self._decoding():
            return None
        long = [seq for seq in self.queues.running
                if not seq.in_decode and self.limits.is_long(seq) and not seq.in_prompt_pass]
        if not long:
            return None
        seq = min(long, key=lambda s: s.sort_key)
        num_new = tokens_to_run(seq, self.limits.max_num_batched_tokens, self.limits, weighted=False)
        needed = self.blocks.needed(seq, num_new)
        if num_new <= 0 or not self.pool.can_allocate(needed):
            return None
        self.blocks.grow(seq, needed)
        self.in_flight = (seq, make_chunk(seq, num_new))
        self._in_flight_units = self.limits.chunk_cost(seq.num_computed_tokens, num_new)
        return self.in_flight[1]

    def take_in_flight(self) -> tuple[Sequence, ScheduledChunk] | None:
        """The chunk in flight, which has run its last layer; it is in flight no more."""
        done, self.in_flight = self.in_flight, None
        return done

    def drop(self, seq: Sequence) -> None:
        """`seq` is finishing (an abort): its chunk in flight is dropped with it."""
        if self.in_flight is not None and self.in_flight[0] is seq:
            self.in_flight = None

    def layers_to_run(self, layers_left: int, elapsed: float) -> int:
        """Layers of the chunk in flight to run after a step that took `elapsed` seconds: what fits in the rest of
        the target beside decodes (at least one), all of them with no decode waiting."""
        if self.limits.itl_target is None or not self._decoding():
            return layers_left
        return min(layers_left, self.times.layers_within(self.limits.itl_target - elapsed, self._in_flight_units))

    def planned(self, plan: StepPlan) -> None:
        """The step just planned, for step_took to learn from."""
        decodes = sum(n + slots for seq, n, slots in plan.runs if seq.in_decode)
        units = sum(self.limits.run_cost(seq, n, plan.weighted) for seq, n, _ in plan.runs if not seq.in_decode)
        self._last_step = (decodes, units)

    def step_took(self, seconds: float) -> None:
        """The step planned last ran for `seconds` (the chunk in flight's layers apart: layers_took)."""
        self.times.observe(*self._last_step, seconds)

    def layers_took(self, count: int, seconds: float) -> None:
        self.times.observe_layers(count, self._in_flight_units, seconds)

    def _decoding(self) -> bool:
        return any(seq.in_decode for seq in self.queues.running)
