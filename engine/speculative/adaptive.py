"""Adaptive K: each sequence speculates as far as its recent acceptance rate says pays off.

A running average (EMA) of the fraction of proposed tokens that were accepted moves K up or down by one per
verification step. At K = 0 speculation pauses for a number of decode steps (doubling each time it pauses
again, up to a cap) and then probes with K = 1. Purely count-based, so seeded requests stay reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

EMA_WEIGHT = 0.3  # weight of the newest step in the running acceptance rate
GROW_ABOVE = 0.6  # acceptance rate above which K grows by one
SHRINK_BELOW = 0.3  # ... below which it shrinks by one
FIRST_PAUSE = 8  # decode steps without speculation after K first reaches 0
MAX_PAUSE = 128
PROBE_RATE = 0.5  # the acceptance estimate a probe starts from: neither grows nor shrinks K by itself


@dataclass(frozen=True)
class SpecState:
    max_k: int
    k: int
    acceptance: float = PROBE_RATE
    pause: int = 0  # decode steps left with speculation off
    next_pause: int = FIRST_PAUSE

    @classmethod
    def start(cls, max_k: int) -> SpecState:
        return cls(max_k=max_k, k=max_k)


def adapt(state: SpecState, proposed: int, accepted: int) -> SpecState:
    """The state after one decode step of the sequence that verified `proposed` drafts and kept `accepted`."""
    if state.pause:
        return _tick_pause(state)
    if proposed == 0:  # nothing was proposed (no n-gram match, proposer down): nothing learned
        return state
    rate = (1 - EMA_WEIGHT) * state.acceptance + EMA_WEIGHT * accepted / proposed
    if rate > GROW_ABOVE:
        return replace(state, acceptance=rate, k=min(state.k + 1, state.max_k), next_pause=FIRST_PAUSE)
    if rate < SHRINK_BELOW:
        return _shrink(replace(state, acceptance=rate))
    return replace(state, acceptance=rate)


def _shrink(state: SpecState) -> SpecState:
    if state.k > 1:
        return replace(state, k=state.k - 1)
    return replace(state, k=0, pause=state.next_pause, next_pause=min(2 * state.next_pause, MAX_PAUSE))


def _tick_pause(state: SpecState) -> SpecState:
    if state.pause > 1:
        return replace(state, pause=state.pause - 1)
    return replace(state, pause=0, k=1, acceptance=PROBE_RATE)


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding of one sample (or one request, summed over its samples): draft tokens verified,
    accepted, and verification steps (one sequence, one step, at least one draft)."""

    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_verify_steps: int = 0

    def record(self, proposed: int, accepted: int) -> SpecCounts:
        return SpecCounts(self.num_draft_proposed + proposed, self.num_draft_accepted + accepted,
                          self.num_verify_steps + 1)

    def __add__(self, other: SpecCounts) -> SpecCounts:
        return SpecCounts(self.num_draft_proposed + other.num_draft_proposed,
                          self.num_draft_accepted + other.num_draft_accepted,
                          self.num_verify_steps + other.num_verify_steps)

    @property
    def acceptance_rate(self) -> float:
        return self.num_draft_accepted / self.num_draft_proposed if self.num_draft_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafts accepted per verification step (the target's own token not counted)."""
        return self.num_draft_accepted / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass
class SpecCounters:
    """Cumulative engine counters; mean accepted length per verification = accepted / steps."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verification steps of one sequence that had at least one draft

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
