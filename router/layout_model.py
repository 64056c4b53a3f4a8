"""How well a layout of prefill and decode actors would serve a traffic mix: the predicted goodput (requests per
second within their TTFT and ITL targets) of each candidate, from the actors' measured cost curves.

A layout is `p` prefill actors and `d` decode actors sharing the machine's switchable actors, or one decode actor
on the cores of all of them (the others parked: `lent`), with its curves widened to that many shares. In it, a
long-in request (its quadrant's) is prefilled on a prefill actor and handed off when there is one (as `auto` placement
mostly decides), every other request on its decode actor, colocated. Traffic spreads evenly over the actors of a
role. For each actor, with the class rates `l`, mean prompt `P` and output `O`:

- a decode actor spends `rho_pf = sum l * prefill(P)` of each second prefilling colocated prompts and decodes in
  the rest: a batch `B` of streams takes `step(B) = d0 + d1 * B` per step and must emit `sum l * O` tokens per
  second, so `B = tau * d0 / ((1 - rho_pf) - tau * d1)`; its time per output token is
  `tpot = step(B) / (1 - rho_pf)` (the steps stretched by the prefill work between them);
- prefill work queues (M/G/1): a prompt waits `W = sum l * S^2 / (2 (1 - rho))` on average (Pollaczek-Khinchine),
  with `S` the prompt's service time (its prefill, plus the decode rows of each chunk step on a decode actor) and
  `rho = sum l * S`; the share within a TTFT target `T` is `1 - rho * exp(-rho * (T - S) / W)` (exact for M/M/1),
  none when `S > T`;
- prompts queued now add their prefill time, spread over the actors that will run them, to the wait;
- an actor whose work exceeds its time (`rho >= 1`, or decode demand beyond `(1 - rho_pf) / d1`) is overloaded: its
  requests count for nothing.

A request class counts `rate * P(TTFT within target)` when its time per token is within the ITL target, else nothing.
This is a steady-state model of means: it ranks layouts for the mix, it does not predict tail latencies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from router.cost_model import DecodeCost, PrefillCost
from router.traffic import ClassLoad, Mix


@dataclass(frozen=True, order=True)
class Layout:
    prefill: int
    decode: int
    lent: int = 0  # actors parked with their cores lent to the decode actor (router/merges.py): one merged actor

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1 or self.lent < 0:
            raise ValueError(f"a layout needs at least one decode actor and no negative count, got {self!r}")
        if self.lent and (self.prefill or self.decode != 1):
            raise ValueError(f"actors lend their cores to one decode actor and no prefill actor, got {self!r}")

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D" + (f"*{self.cores}" if self.lent else "")

    @property
    def size(self) -> int:
        return self.prefill + self.decode + self.lent

    @property
    def cores(self) -> int:
        """The share of the machine each decode actor runs on, in actors' shares."""
        return 1 + self.lent // self.decode


def candidates(size: int, mergeable: bool = False) -> list[Layout]:
    """Every layout of `size` switchable actors (at least one decodes), and, when their cores can be merged, one
    decode actor on all of them."""
    return [Layout(p, size - p) for p in range(size)] + ([Layout(0, 1, size - 1)] if mergeable and size > 1 else [])


@dataclass(frozen=True)
class Targets:
    ttft: float  # short prompts
    ttft_long: float
    itl: float

    def ttft_for(self, load: ClassLoad) -> float:
        return self.ttft_long if load.long_prompt else self.ttft


@dataclass(frozen=True)
class ActorCosts:
    """One actor's measured curves (the switchable actors share a machine and a core count)."""

    prefill: PrefillCost
    decode: DecodeCost
    step_tokens: int = 512  # prefill tokens per engine step (a colocated chunk)

    def widened(self, cores: int) -> "ActorCosts":
        """An estimate of the curves on `cores` actors' shares of the machine, from one share's: the work that
        grows with tokens and sequences (the products) divides among the cores; a step's fixed cost (the Python
        around it, one sequence's weights read) does not. Optimistic for prefill, where threads never scale
        perfectly, pessimistic for the fixed cost, whose weight reads do share out."""
        if cores == 1:
            return self
        p, d = self.prefill, self.decode
        return ActorCosts(PrefillCost(p.fixed, p.per_token / cores, p.per_token_sq / cores),
                          DecodeCost(d.fixed, d.per_seq / cores), self.step_tokens)


@dataclass(frozen=True)
class ClassPrediction:
    quadrant: str
    path: str  # "colocated" | "disaggregated"
    ttft: float  # mean, seconds (inf when overloaded)
    tpot: float  # mean time per output token, seconds
    within: float  # predicted share within both targets

    def to_dict(self) -> dict:
        return {"quadrant": self.quadrant, "path": self.path, "ttft": _rounded(self.ttft),
                "tpot": _rounded(self.tpot), "within": round(self.within, 4)}


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    goodput: float  # requests per second within their targets
    offered: float  # requests per second arriving
    classes: tuple[ClassPrediction, ...]
    overloaded: bool

    def to_dict(self) -> dict:
        return {"layout": str(self.layout), "goodput": round(self.goodput, 4), "offered": round(self.offered, 4),
                "overloaded": self.overloaded, "classes": [c.to_dict() for c in self.classes]}


@dataclass(frozen=True)
class _Queue:
    """The prefill work on one actor: its load, mean wait and the service time of each class."""

    rho: float
    wait: float
    service: dict[str, float]

    def within(self, quadrant: str, target: float) -> float:
        service = self.service[quadrant]
        if self.rho >= 1 or service > target:
            return 0.0
        if self.wait <= 0:
            return 1.0
        return max(0.0, 1.0 - self.rho * math.exp(-self.rho * (target - service) / self.wait))


def predict(layout: Layout, mix: Mix, costs: ActorCosts, targets: Targets) -> Prediction:
    costs = costs.widened(layout.cores)
    disagg = tuple(c for c in mix.classes if c.long_prompt and layout.prefill)
    coloc = tuple(c for c in mix.classes if c not in disagg)
    tpot, decode_ok, batch = _decode(layout, mix.classes, coloc, costs)
    step = costs.decode.step_seconds(batch)
    decode_queue = _queue([(c, c.rate / layout.decode, _colocated_service(c, costs, step)) for c in coloc],
                          _backlog(mix, layout.decode, costs, share=1.0 if not layout.prefill else 0.0))
    prefill_queue = _queue([(c, c.rate / layout.prefill, costs.prefill.seconds(round(c.prompt_tokens)))
                            for c in disagg], _backlog(mix, layout.prefill, costs, share=1.0)) if disagg else None
    preds = []
    for c in mix.classes:
        queue = prefill_queue if c in disagg else decode_queue
        within = queue.within(c.quadrant, targets.ttft_for(c)) if decode_ok and tpot <= targets.itl else 0.0
        ttft = queue.wait + queue.service[c.quadrant] if queue.rho < 1 else math.inf
        preds.append(ClassPrediction(c.quadrant, "disaggregated" if c in disagg else "colocated", ttft, tpot, within))
    overloaded = not decode_ok or decode_queue.rho >= 1 or (prefill_queue is not None and prefill_queue.rho >= 1)
    goodput = sum(c.rate * p.within for c, p in zip(mix.classes, preds))
    return Prediction(layout, goodput, mix.rate, tuple(preds), overloaded)


def _decode(layout: Layout, every: tuple[ClassLoad, ...], coloc: tuple[ClassLoad, ...],
            costs: ActorCosts) -> tuple[float, bool, float]:
    """(time per output token, whether the decode actors keep up, their batch) for each decode actor's share."""
    d = layout.decode
    rho_pf = sum(c.rate / d * costs.prefill.seconds(round(c.prompt_tokens)) for c in coloc)
    tau = sum(c.rate / d * c.output_tokens for c in every)  # tokens per second each decode actor emits
    room = (1 - rho_pf) - tau * costs.decode.per_seq
    if rho_pf >= 1 or room <= 0:
        return math.inf, False, 0.0
    batch = tau * costs.decode.fixed / room
    return costs.decode.step_seconds(batch) / (1 - rho_pf), True, batch


def _colocated_service(c: ClassLoad, costs: ActorCosts, step: float) -> float:
    """A colocated prompt's prefill, plus the decode rows that ride along in each of its chunk steps."""
    tokens = round(c.prompt_tokens)
    chunks = max(1, math.ceil(tokens / max(costs.step_tokens, 1)))
    return costs.prefill.seconds(tokens) + chunks * step


def _queue(work: list[tuple[ClassLoad, float, float]], backlog: float) -> _Queue:
    """(class, its rate on this actor, service seconds) -> the M/G/1 load and mean wait, plus half the backlog."""
    rho = sum(rate * service for _, rate, service in work)
    second_moment = sum(rate * service * service for _, rate, service in work)
    wait = math.inf if rho >= 1 else second_moment / (2 * (1 - rho)) + backlog / 2
    return _Queue(rho, wait, {c.quadrant: service for c, _, service in work})


def _backlog(mix: Mix, actors: int, costs: ActorCosts, share: float) -> float:
    """Seconds of prefill the prompts queued now put on each of `actors` (a `share` of them runs there)."""
    if not actors or not mix.queued_prompt_tokens or not share:
        return 0.0
    return share * costs.prefill.per_token * mix.queued_prompt_tokens / actors


def _rounded(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else round(value, 4)
