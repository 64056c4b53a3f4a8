"""The planner: which layout of prefill and decode actors to run next, decided from the live mix.

At each decision it predicts the goodput of every candidate layout for the traffic of the last window
(router/layout_model.py) and compares the best with the current layout. The current layout's goodput is the
larger of its prediction and what its finished requests showed, once `min_requests` have finished in the window
(losses the model predicts but the traffic does not show are not believed: a layout that serves nearly every
request within its targets is left alone). A switch is taken only when all of these hold:

- gain: the best layout's predicted goodput is at least `margin` above the current one's;
- payoff: that gain over the next `window` seconds exceeds what the switch costs: the actor that changes serves
  nothing while it changes (`switch_seconds`, learnt from the changes so far) and the streams it holds are
  prefilled again elsewhere, both counted as that actor's share of the current goodput;
- dwell: the same better layout won `dwell` consecutive decisions (noise in the arrivals does not switch);
- cooldown: `cooldown` seconds have passed since the last switch (a switch is not undone at once).

The candidates are every split of the actors between the two roles and, where their cores can be merged, one
decode actor on all of them (its curves estimated from one share's: ActorCosts.widened).

The planner decides; router/elastic.py acts (role changes, or a merge or split of cores) and shows the decisions.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from router.elastic_settings import ElasticSettings
from router.layout_model import ActorCosts, Layout, Prediction, Targets, candidates, predict
from router.traffic import Mix


@dataclass(frozen=True)
class SwitchCost:
    """What one role change costs, in seconds of one actor's service."""

    seconds: float  # the change itself (the actor serves nothing)
    reprefill_seconds: float = 0.0  # prefilling again the streams it holds, on the actors that take them

    @property
    def total(self) -> float:
        return self.seconds + self.reprefill_seconds


@dataclass(frozen=True)
class Decision:
    at: float  # Unix time
    current: Layout
    target: Layout  # == current when it stays
    switch: bool
    reason: str
    predictions: tuple[Prediction, ...]
    gain: float = 0.0  # requests within targets won over the horizon
    cost: float = 0.0  # requests within targets lost to the switch

    def to_dict(self) -> dict:
        return {"at": round(self.at, 3), "current": str(self.current), "target": str(self.target),
                "switch": self.switch, "reason": self.reason, "gain": round(self.gain, 3),
                "cost": round(self.cost, 3), "candidates": [p.to_dict() for p in self.predictions]}


class Planner:
    """The hysteresis between decisions: the streak of the best layout and the time of the last switch."""

    def __init__(self, settings: ElasticSettings) -> None:
        self.settings = settings
        self.targets = Targets(settings.slo_ttft, settings.slo_ttft_long, settings.slo_itl)
        self.streak: tuple[Layout | None, int] = (None, 0)
        self.last_switch = -math.inf  # monotonic

    def decide(self, now: float, current: Layout, mix: Mix, costs: ActorCosts, cost: SwitchCost,
               mergeable: bool = False) -> Decision:
        """`now`: monotonic seconds (a fake clock in tests); `mergeable`: the actors' cores can go to one of them
        (router/merges.py), so one decode actor on all of them is a candidate."""
        predictions = tuple(predict(layout, mix, costs, self.targets)
                            for layout in candidates(current.size, mergeable or bool(current.lent)))
        by_layout = {p.layout: p for p in predictions}
        best = max(predictions, key=lambda p: (p.goodput, p.layout == current))
        held, source = self._held_goodput(by_layout[current], mix)
        gain = (best.goodput - held) * self.settings.window
        loss = held / current.size * cost.total
        reason = self._refusal(now, current, best, f"{current}'s {held:.3g} ({source})", held, gain, loss)
        self.streak = (best.layout, self.streak[1] + 1 if self.streak[0] == best.layout else 1)
        if reason is None and self.streak[1] < self.settings.dwell:
            reason = f"{best.layout} has led {self.streak[1]} of the {self.settings.dwell} decisions a switch needs"
        switch = reason is None
        if switch:
            self.last_switch, self.streak = now, (None, 0)
            reason = (f"{best.layout} is predicted to serve {best.goodput:.3g} req/s within targets against "
                      f"{current}'s {held:.3g} ({source}): {gain:.3g} more requests over {self.settings.window:g} s "
                      f"for {loss:.3g} lost to the switch")
        return Decision(time.time(), current, best.layout if switch else current, switch, reason, predictions,
                        gain, loss)

    def _held_goodput(self, current: Prediction, mix: Mix) -> tuple[float, str]:
        """The current layout's goodput, predicted or as its finished requests showed (the larger)."""
        observed = mix.observed
        if observed.finished < self.settings.min_requests or math.isnan(observed.attainment) \
                or observed.attainment * mix.rate <= current.goodput:
            return current.goodput, "predicted"
        return observed.attainment * mix.rate, f"observed: {observed.attainment:.0%} within targets"

    def _refusal(self, now: float, current: Layout, best: Prediction, held_text: str, held: float, gain: float,
                 loss: float) -> str | None:
        """Why not switch now, or None."""
        s = self.settings
        if best.layout == current:
            return f"{current} is predicted best ({best.goodput:.3g} req/s within targets)"
        if best.goodput < held * (1 + s.margin) or best.goodput <= held:
            return f"{best.layout} is predicted at {best.goodput:.3g} req/s, not {s.margin:.0%} above {held_text}"
        if gain <= loss:
            return f"the gain ({gain:.3g} requests over {s.window:g} s) does not pay for the switch ({loss:.3g})"
        if now - self.last_switch < s.cooldown:
            return f"the last switch was {now - self.last_switch:.0f} s ago (cooldown {s.cooldown:g} s)"
        return None

