"""How one step's prefill budget is shared between a long prompt already running and short prompts arriving.

Without a rule, a running long prefill takes every token the decodes leave, and a short request that arrives
behind it waits for the whole prefill (seconds on a CPU) before its first token. The rule, stall-free as in
Sarathi-Serve:

- Decodes come first, whatever else runs (one token each, plus draft slots).
- A prompt is *long* when its request's quadrant says so (LISO / LILO, `Sequence.long_prompt`) or, without a
  quadrant, when it cannot be prefilled in one step's budget. Short prompts that are ready to start get a
  share of the prefill budget ahead of a running long prefill: as many tokens as they need, up to
  `PrefillShares.reserve` (engine/config.py), so a short request starts within a step of arriving.
- The long prefill keeps the rest, at least `budget / long_prefill_slowdown`: however many short prompts
  arrive, it progresses every step and its prefill takes at most that factor longer than alone. What the short
  prompts leave unused goes back to it in the same step (`RunningPlanner.extend`), so nothing is wasted.
- At most `max_partial_prefills` prompts are part-way through their prefill at once, and at most
  `max_long_partial_prefills` of them long: a second long prompt waits for the first instead of splitting
  the budget in two, and never holds up a short one behind it.
"""
from __future__ import annotations

from engine.core.sequence import Sequence


def is_long(seq: Sequence, step_budget: int) -> bool:
    """The request's quadrant where it has one; else whether its prompt outgrows one step."""
    if seq.long_prompt is not None:
        return seq.long_prompt
    return seq.num_tokens > step_budget
