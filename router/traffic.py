"""The live traffic mix as the planner sees it: over the last `window` seconds, per quadrant, how many requests
arrived (a rate), how long their prompts and outputs were, and for those that finished, their TTFT and mean time
per output token against the targets.

Every method takes the time (`now`, monotonic seconds) from its caller, so that tests drive it with a fake clock.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from router.elastic_settings import ElasticSettings

QUADRANTS = ("SISO", "LISO", "SILO", "LILO")  # short/long in, short/long out (as the server's quadrant labels)


def quadrant(long_prompt: bool, long_output: bool) -> str:
    return f"{'L' if long_prompt else 'S'}I{'L' if long_output else 'S'}O"


@dataclass(frozen=True)
class Arrival:
    at: float
    quadrant: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Completion:
    at: float
    quadrant: str
    ttft: float
    tpot: float | None  # None for a single output token
    output_tokens: int
    met: bool  # within its TTFT and ITL targets


@dataclass(frozen=True)
class ClassLoad:
    """One quadrant's traffic in the window: a rate, and the mean prompt and output lengths."""

    quadrant: str
    rate: float  # requests per second
    prompt_tokens: float
    output_tokens: float  # what finished requests produced, else what arrivals asked for (max_tokens)

    @property
    def long_prompt(self) -> bool:
        return self.quadrant.startswith("L")


@dataclass(frozen=True)
class Observed:
    """What finished requests in the window measured."""

    finished: int = 0
    ttft_p50: float = math.nan
    ttft_p90: float = math.nan
    tpot_p50: float = math.nan
    tpot_p90: float = math.nan
    attainment: float = math.nan  # share of finished requests within their targets

    def to_dict(self) -> dict:
        return {"finished": self.finished, "ttft_p50": _finite(self.ttft_p50), "ttft_p90": _finite(self.ttft_p90),
                "tpot_p50": _finite(self.tpot_p50), "tpot_p90": _finite(self.tpot_p90),
                "attainment": _finite(self.attainment)}


@dataclass(frozen=True)
class Mix:
    """The window's traffic, and what waits now."""

    classes: tuple[ClassLoad, ...]
    span: float  # seconds the window covers (shorter than the window just after a start)
    queued_prompt_tokens: int = 0  # prompt tokens of requests not prefilled yet (queued or parked)
    observed: Observed = Observed()

    @property
    def rate(self) -> float:
        return sum(c.rate for c in self.classes)

    def to_dict(self) -> dict:
        return {"span_seconds": round(self.span, 3), "queued_prompt_tokens": self.queued_prompt_tokens,
                "quadrants": {c.quadrant: {"rate": round(c.rate, 4), "prompt_tokens": round(c.prompt_tokens, 1),
                                           "output_tokens": round(c.output_tokens, 1)} for c in self.classes},
                "observed": self.observed.to_dict()}


class TrafficWindow:
    """Arrivals and completions of the last `settings.window` seconds."""

    def __init__(self, settings: ElasticSettings, started: float) -> None:
        self.settings = settings
        self.started = started
        self.arrivals: deque[Arrival] = deque()
        self.completions: deque[Completion] = deque()

    def classify(self, prompt_tokens: int, max_tokens: int | None, long_prompt: bool | None = None) -> str:
        """The quadrant: long-in as the request's treatment says, else by the prompt's length; no max_tokens (the
        rest of the context) is long-out."""
        if long_prompt is None:
            long_prompt = prompt_tokens >= self.settings.long_prompt_tokens
        return quadrant(long_prompt, max_tokens is None or max_tokens >= self.settings.long_output_tokens)

    def arrival(self, now: float, prompt_tokens: int, max_tokens: int | None, long_prompt: bool | None = None) -> None:
        asked = self.settings.long_output_tokens if max_tokens is None else max_tokens
        self.arrivals.append(Arrival(now, self.classify(prompt_tokens, max_tokens, long_prompt), prompt_tokens, asked))

    def completion(self, now: float, quadrant_: str, ttft: float, tpot: float | None, output_tokens: int) -> None:
        """A request finished: `ttft` from its arrival, `tpot` its mean time per token after the first."""
        self.completions.append(Completion(now, quadrant_, ttft, tpot, output_tokens,
                                           self.within_targets(quadrant_, ttft, tpot)))

    def within_targets(self, quadrant_: str, ttft: float, tpot: float | None) -> bool:
        s = self.settings
        ttft_target = s.slo_ttft_long if quadrant_.startswith("L") else s.slo_ttft
        return ttft <= ttft_target and (tpot is None or tpot <= s.slo_itl)

    def snapshot(self, now: float, queued_prompt_tokens: int = 0) -> Mix:
        self._expire(now)
        span = max(min(self.settings.window, now - self.started), 1e-9)
        classes = tuple(self._class(q, span) for q in QUADRANTS if any(a.quadrant == q for a in self.arrivals))
        return Mix(classes, span, queued_prompt_tokens, self._observed())

    def _class(self, quadrant_: str, span: float) -> ClassLoad:
        arrived = [a for a in self.arrivals if a.quadrant == quadrant_]
        done = [c.output_tokens for c in self.completions if c.quadrant == quadrant_]
        output = _mean(done) if done else _mean([a.max_tokens for a in arrived])
        return ClassLoad(quadrant_, len(arrived) / span, _mean([a.prompt_tokens for a in arrived]), output)

    def _observed(self) -> Observed:
        done = list(self.completions)
        if not done:
            return Observed()
        ttft = [c.ttft for c in done]
        tpot = [c.tpot for c in done if c.tpot is not None]
        return Observed(len(done), _quantile(ttft, 0.5), _quantile(ttft, 0.9), _quantile(tpot, 0.5),
                        _quantile(tpot, 0.9), sum(c.met for c in done) / len(done))

    def _expire(self, now: float) -> None:
        horizon = now - self.settings.window
        for events in (self.arrivals, self.completions):
            while events and events[0].at < horizon:
                events.popleft()


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)
