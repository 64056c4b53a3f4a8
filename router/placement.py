"""Per-request placement: colocate on a decode actor (chunked prefill) or disaggregate (prefill actor, then
KV hand-off), decided from measured costs rather than a fixed prompt-length threshold."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from router.cost_model import DecodeCost, PrefillCost, TransferCost

PlacementMode = Literal["auto", "always", "never"]  # --disagg: decide per request, always or never disaggregate
PlacementPath = Literal["colocated", "disaggregated"]  # where one request's prefill runs (the x-path header)
COLOCATED: PlacementPath = "colocated"
DISAGGREGATED: PlacementPath = "disaggregated"


@dataclass(frozen=True)
class DecodeActorView:
    """What the router knows about one decode actor when it places a request."""

    actor_id: str
    running: float  # streams a colocated prefill would stall: decoding now (or as many as usually do)
    free_blocks: int
    cached_prompt_tokens: int  # of this request's prompt, already in the actor's prefix cache
    prefill: PrefillCost  # its own prefill speed (used when colocating)
    decode: DecodeCost
    queued_prefill_tokens: int = 0  # colocated prompt tokens it has not run yet
    arrival_rate: float = 0.0  # requests/s reaching this actor: streams that start during a colocated prefill
    step_tokens: int = 0  # its engine's token budget per step (0: unknown)
    # of this request's prompt, past the cached prefix, in the KV tiers below its pool: loaded at admission
    # instead of computed when the prompt runs colocated (a hand-off prefills it on the prefill actor)
    loadable_prompt_tokens: int = 0

    def colocated_uncached(self, prompt_tokens: int) -> int:
        """The prompt tokens a colocated prefill computes: neither cached nor loaded from the tiers."""
        return max(prompt_tokens - self.cached_prompt_tokens - self.loadable_prompt_tokens, 0)


@dataclass(frozen=True)
class PrefillActorView:
    actor_id: str
    prefill: PrefillCost
    queued_tokens: int = 0  # prompt tokens ahead of this request
    transfer: TransferCost = TransferCost(0.0, float("inf"))  # to the decode actor being considered


@dataclass(frozen=True)
class PlacementPolicy:
    mode: PlacementMode = "auto"
    interference_weight: float = 1.0  # seconds of others' stall valued against seconds of this TTFT
    margin: float = 0.05  # disaggregate only when it is at least this much cheaper (fraction)
    # A stall up to this long costs a running stream nothing: one late token within its inter-token budget
    # (a decode step is ~0.1 s here and a typical TPOT objective 0.2 s). Short prompts then colocate
    # while streams run, instead of queueing behind long prompts on a prefill actor.
    itl_slack: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in get_args(PlacementMode):
            raise ValueError(f"disagg mode must be auto, always or never, got {self.mode!r}")


@dataclass(frozen=True)
class Placement:
    path: PlacementPath
    decode_actor: str
    prefill_actor: str | None
    colocated_cost: float  # estimated seconds: own TTFT + weighted stall inflicted on running streams
    disaggregated_cost: float | None
    uncached_tokens: int
    estimated_ttft: float
    moves: tuple[str, ...] = ()  # the stream's migrations so far ("decode-0->decode-1"), set by the router

    def header(self) -> str:
        """The X-Placement response header: decision and the estimates behind it."""
        disagg = "n/a" if self.disaggregated_cost is None else f"{self.disaggregated_cost * 1e3:.1f}ms"
        return (f"{self.path}; decode={self.decode_actor}; prefill={self.prefill_actor or '-'}; "
                f"colocated={self.colocated_cost * 1e3:.1f}ms; disaggregated={disagg}; "
                f"uncached={self.uncached_tokens}")


def choose_decode_actor(actors: list[DecodeActorView], prompt_tokens: int,
                        block_size: int) -> DecodeActorView | None:
    """The actor caching the longest prefix of the prompt, then the least loaded; None if none can fit it."""
    fitting = [a for a in actors
               if a.free_blocks * block_size >= prompt_tokens + 1 - a.cached_prompt_tokens]
    if not fitting:
        return None
    return max(fitting, key=lambda a: (a.cached_prompt_tokens, -a.running, -a.queued_prefill_tokens))


def colocated_cost(actor: DecodeActorView, prompt_tokens: int, weight: float,
                   itl_slack: float = 0.0, short: bool = False) -> tuple[float, float]:
    """(cost, ttft): the prompt's uncached part prefilled on the decode actor (after the prompts queued there,
    colocated_ttft), stalling each running stream by the prefill compute beyond `itl_slack`, and the streams
    that arrive meanwhile by half of it on average. Tokens the KV tiers hold cost nothing: loading a block is a
    copy, far cheaper than its prefill on a CPU."""
    uncached = actor.colocated_uncached(prompt_tokens)
    prefill = actor.prefill.seconds(uncached)
    ttft = colocated_ttft(actor, uncached, short)
    stall = actor.running * max(0.0, prefill - itl_slack)
    stall += actor.arrival_rate * prefill * max(0.0, prefill / 2 - itl_slack)
    return ttft + weight * stall, ttft


def colocated_ttft(actor: DecodeActorView, uncached: int, short: bool) -> float:
    """A long prompt waits for every prompt queued before it. A short one (its quadrant's, or one step's worth)
    starts beside a running long prefill (the engine's stall-free shares, engine/scheduler/shares.py): it waits
    for the step in progress, then runs in a step that the queued prefill fills up to the budget."""
    queued = actor.queued_prefill_tokens
    if not short or actor.step_tokens <= 0 or not queued:
        return actor.prefill.seconds(queued + uncached)
    in_progress = min(queued, actor.step_tokens)
    return actor.prefill.seconds(in_progress) + actor.prefill.seconds(max(uncached, min(queued + uncached,
                                                                                        actor.step_tokens)))


def disaggregated_cost(decode: DecodeActorView, prefill: PrefillActorView, prompt_tokens: int,
                       kv_bytes_per_token: int) -> float:
    """TTFT when a prefill actor runs the uncached part and hands the KV over; the decode actor is not stalled."""
    uncached = prompt_tokens - decode.cached_prompt_tokens
    queue = prefill.prefill.seconds(prefill.queued_tokens)
    return queue + prefill.prefill.seconds(uncached) + prefill.transfer.seconds(uncached * kv_bytes_per_token)


def place(policy: PlacementPolicy, prompt_tokens: int, block_size: int, decode_actors: list[DecodeActorView],
          prefill_actors: list[PrefillActorView], kv_bytes_per_token: int, short: bool = False) -> Placement | None:
    """None when no decode actor can hold the request (the caller answers 429). `short`: the prompt starts
    beside a running long prefill (colocated_ttft)."""
    decode = choose_decode_actor(decode_actors, prompt_tokens, block_size)
    if decode is None:
        return None
    coloc, ttft = colocated_cost(decode, prompt_tokens, policy.interference_weight, policy.itl_slack, short)
    uncached = decode.colocated_uncached(prompt_tokens)
    best = _best_prefill(decode, prefill_actors, prompt_tokens, kv_bytes_per_token)
    if best is None or policy.mode == "never":
        return Placement(COLOCATED, decode.actor_id, None, coloc, best and best[1], uncached, ttft)
    prefill, disagg = best
    if policy.mode == "always" or disagg * (1 + policy.margin) < coloc:
        return Placement(DISAGGREGATED, decode.actor_id, prefill.actor_id, coloc, disagg,
                         prompt_tokens - decode.cached_prompt_tokens, disagg)
    return Placement(COLOCATED, decode.actor_id, None, coloc, disagg, uncached, ttft)


def _best_prefill(decode: DecodeActorView, prefill_actors: list[PrefillActorView], prompt_tokens: int,
                  kv_bytes_per_token: int) -> tuple[PrefillActorView, float] | None:
    costed = [(p, disaggregated_cost(decode, p, prompt_tokens, kv_bytes_per_token)) for p in prefill_actors]
    return min(costed, key=lambda pc: pc[1]) if costed else None
