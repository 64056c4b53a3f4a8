"""Placement in the running router: views of the live actors for `router.placement.place`, built from their
heartbeats, their calibration and the router's own books, and the online correction of the prefill costs.

`router.placement` decides from views alone (pure, tested without processes); this module builds the views.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Mapping, Sequence

from actors.spec import Role
from actors.supervisor import ActorHandle, Supervisor
from engine.core.engine_core import EngineRequest
from engine.kv.prefix_index import prefix_block_hashes
from engine.kv.tier_store import stored_depth
from router.cost_model import ArrivalRate, DecodeCost, LinkEstimate, PrefillCost, Smoothed, TransferCost
from router.handoff import HANDOFF_PHASES, Phase, Routed, node_of, shares_memory
from router.placement import DecodeActorView, Placement, PlacementPolicy, PrefillActorView, choose_decode_actor, place

# Costs until calibration measures them (a 135M model on one CPU core, roughly).
DEFAULT_PREFILL = PrefillCost(fixed=0.01, per_token=0.002)
DEFAULT_DECODE = DecodeCost(fixed=0.03, per_seq=0.002)
SHM_TRANSFER = TransferCost(latency=0.001, bytes_per_second=float("inf"))  # written in place: no copy
# Pages streamed to a decode actor on another host (bench/kv_transfer.py on loopback: 0.2-1 GB/s; a real network
# is slower), until the transfers on that link measure it (Placer.links).
TCP_TRANSFER = TransferCost(latency=0.005, bytes_per_second=2.5e8)
MIN_CORRECTION_TOKENS = 256  # shorter prompts do not correct the prefill cost curves (see record_estimate)
STREAMS_AVERAGE_WEIGHT = 0.1  # EWMA of each decode actor's streams, sampled at every placement
NEVER = PlacementPolicy("never")


class Placer:
    def __init__(self, supervisor: Supervisor, routed: Mapping[str, Routed], policy: PlacementPolicy) -> None:
        self.supervisor, self.routed, self.policy = supervisor, routed, policy
        self.corrections: dict[str, Smoothed] = {}  # actor -> observed / predicted prefill time
        self.estimate_errors: deque[float] = deque(maxlen=1024)  # |predicted - observed| / observed
        self.streams_average: dict[str, float] = {}  # decode actor -> EWMA of its streams at placements
        self.arrivals = ArrivalRate()
        self.links: dict[tuple[str, str], LinkEstimate] = {}  # (prefill node, decode node) -> its measured cost

    def observe_arrival(self, now: float) -> None:
        """A new request (a retry is no arrival)."""
        self.arrivals = self.arrivals.observe(now)

    def place(self, request: EngineRequest) -> Placement | None:
        """Where the request should run now; None when no decode actor is up."""
        decodes = self.supervisor.ready(Role.DECODE)
        if not decodes:
            return None
        block_size = decodes[0].ready.block_size
        prompt = request.num_context_tokens  # a resumed stream prefills its emitted tokens too
        tokens = request.context_token_ids
        hashes = prefix_block_hashes(tokens[:len(tokens) - 1], block_size) \
            if any("kv_tiers" in h.ready.kv_export for h in decodes) else []
        views = {h.actor_id: self._decode_view(h, self.arrivals.rate / len(decodes), hashes) for h in decodes}
        chosen = choose_decode_actor(list(views.values()), prompt, block_size) or min(
            views.values(), key=lambda v: v.running)  # none has room now: queue on the least loaded
        handle = self.supervisor.by_id(chosen.actor_id)
        prefills = [PrefillActorView(h.actor_id, self.prefill_cost(h), self._queued_prefill(h),
                                     self.transfer_cost(h, handle)) for h in self.supervisor.ready(Role.PREFILL)]
        # A request that asks for what its prompt pass computes (prompt logprobs, an embedding) prefills where it
        # decodes: a hand-off brings back the first token only, and an embedding has nothing to decode.
        policy = self.policy if prefills and not request.params.prompt_outputs else NEVER
        bytes_per_token = int(handle.ready.kv_export.get("bytes_per_token", 0))
        short = _is_short(request, prompt, chosen.step_tokens)
        return place(policy, prompt, block_size, [chosen], prefills, bytes_per_token, short) \
            or place(NEVER, 0, block_size, [chosen], [], bytes_per_token)

    def _decode_view(self, handle: ActorHandle, arrival_rate: float, hashes: Sequence[int]) -> DecodeActorView:
        """Block counts from the last heartbeat; streams and queued prompts from the router's own books,
        which are current (a burst's second request must see the first); what of the prompt (its block
        `hashes`) the actor's KV tiers hold, from their directories."""
        load = handle.load
        free = handle.ready.num_kv_blocks - (load.kv_blocks_used if load else 0)
        streams, queued = self._decode_load(handle.actor_id)
        return DecodeActorView(handle.actor_id, self._expected_streams(handle.actor_id, streams), free, 0,
                               self.prefill_cost(handle), decode_cost(handle), queued, arrival_rate,
                               handle.ready.step_tokens or 0, tier_tokens(handle.ready.kv_export, hashes))

    def _expected_streams(self, actor_id: str, now: int) -> float:
        """Streams a colocated prefill would stall: those running now, or as many as usually run. Sampled at
        arrivals, the average is the time average (Poisson arrivals see time averages); without it an idle
        moment at a long prompt's arrival colocated it, and the streams arriving next sat behind it."""
        previous = self.streams_average.get(actor_id, now)
        average = (1 - STREAMS_AVERAGE_WEIGHT) * previous + STREAMS_AVERAGE_WEIGHT * now
        self.streams_average[actor_id] = average
        return max(float(now), average)

    def _decode_load(self, actor_id: str) -> tuple[int, int]:
        """(sequences decoding on the actor, prompt tokens it has been given to prefill and not finished)."""
        streams = queued = 0
        for r in self.routed.values():
            if r.decode != actor_id or r.phase is not Phase.DECODING:
                continue
            if r.streamed or r.prefill is not None:
                streams += r.request.params.n
            else:
                queued += r.request.num_context_tokens
        return streams, queued

    def _queued_prefill(self, handle: ActorHandle) -> int:
        return sum(r.request.num_context_tokens for r in self.routed.values()
                   if r.prefill == handle.actor_id and r.phase in HANDOFF_PHASES)

    def transfer_cost(self, prefill: ActorHandle, decode: ActorHandle) -> TransferCost:
        """Pages written in place on one node cost ~nothing; a stream costs what its link has measured."""
        if shares_memory(decode, prefill):
            return SHM_TRANSFER
        return self.links.get(link_key(prefill, decode), LinkEstimate(TCP_TRANSFER)).cost

    def record_transfer(self, prefill: ActorHandle, decode_id: str, num_bytes: int, seconds: float) -> None:
        """A direct stream's bytes and busy seconds: the link's bandwidth estimate learns from them, so `auto`
        stops disaggregating over a link that turns out slow."""
        try:
            key = link_key(prefill, self.supervisor.by_id(decode_id))
        except KeyError:
            return
        self.links[key] = self.links.get(key, LinkEstimate(TCP_TRANSFER)).observe(num_bytes, seconds)

    def link_costs(self) -> dict[str, dict]:
        """What /status shows of each measured link."""
        return {f"{a}->{b}": {"bytes_per_second": est.cost.bytes_per_second, "samples": est.samples}
                for (a, b), est in self.links.items()}

    def prefill_cost(self, handle: ActorHandle) -> PrefillCost:
        """Fitted from the actor's start-up calibration, scaled by what live traffic has shown since."""
        samples = (handle.ready.calibration or {}).get("prefill")
        base = PrefillCost.fit(samples) if samples else DEFAULT_PREFILL
        ratio = self.corrections.get(handle.actor_id, Smoothed()).ratio
        return PrefillCost(base.fixed * ratio, base.per_token * ratio, base.per_token_sq * ratio)

    def record_estimate(self, handle: ActorHandle, predicted: float, observed: float, uncached_tokens: int) -> None:
        """Check a prefill estimate against what happened: feeds the error metric and, for prompts long enough
        that compute dominates, the online correction. (The correction scales the whole curve: fed by short
        prompts, whose time is mostly fixed overhead, it doubled the predicted cost of long prompts.)"""
        if uncached_tokens >= MIN_CORRECTION_TOKENS:
            self.corrections[handle.actor_id] = self.corrections.get(handle.actor_id, Smoothed()).observe(
                predicted, observed)
        if observed > 0:
            self.estimate_errors.append(abs(predicted - observed) / observed)

    def calibration(self, handles: list[ActorHandle]) -> dict:
        """What /status shows: each ready prefill or decode actor's fitted costs and the live correction."""
        return {h.actor_id: self._calibration_entry(h) for h in handles if h.spec.role is not Role.DRAFT}

    def _calibration_entry(self, handle: ActorHandle) -> dict:
        cost = self.prefill_cost(handle)
        entry = {"prefill_seconds_per_token": cost.per_token, "prefill_fixed_seconds": cost.fixed,
                 "prefill_seconds_per_token_sq": cost.per_token_sq, "prefill_seconds_512": cost.seconds(512),
                 "correction": self.corrections.get(handle.actor_id, Smoothed()).ratio}
        if handle.spec.role is Role.DECODE:
            decode = decode_cost(handle)
            entry |= {"decode_step_fixed_seconds": decode.fixed, "decode_step_seconds_per_seq": decode.per_seq}
        return entry


def tier_tokens(kv_export: dict, hashes: Sequence[int]) -> int:
    """Prompt tokens (of the block `hashes`) that the KV tiers an actor described in its Ready hold: what its
    admission would load rather than compute (nothing where its tiers are not visible from here)."""
    tiers = kv_export.get("kv_tiers")
    if not tiers or not hashes:
        return 0
    directories = [Path(d) for d in tiers["dirs"]]
    return stored_depth(directories, bytes.fromhex(tiers["namespace"]), list(hashes)) * tiers["block_size"]


def link_key(prefill: ActorHandle, decode: ActorHandle) -> tuple[str, str]:
    """One link per node pair (the nodes the actors reported in their Hello)."""
    return node_of(prefill), node_of(decode)


def decode_cost(handle: ActorHandle) -> DecodeCost:
    calib = handle.ready.calibration or {}
    return DecodeCost.fit(calib["decode"]) if calib.get("decode") else DEFAULT_DECODE


def _is_short(request: EngineRequest, prompt_tokens: int, step_tokens: int) -> bool:
    """As the engine's scheduler judges it (engine/scheduler/shares.is_long): the request's quadrant, else
    whether the prompt fits one step."""
    if request.treatment.long_prompt is not None:
        return not request.treatment.long_prompt
    return 0 < prompt_tokens <= step_tokens
