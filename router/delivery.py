"""Token delivery: the decode actors' TokenUpdates turned into SequenceUpdates for the front end, with what
each token tells the router (a colocated first token checks its estimate; a finished request is forgotten;
every token is remembered, so that a stream can resume elsewhere; a finished request's latencies go to the
traffic window the elastic planner reads)."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from actors.convert import update_from_wire
from actors.supervisor import ActorHandle
from engine.core.step import SequenceUpdate
from router.failover import Failover
from router.handoff import Routed
from router.placer import Placer
from router.traffic import TrafficWindow
from transport import messages as m


class TokenDelivery:
    """Forwards the rows of requests an actor still owns; `trace` holds the stamps of the frame being delivered."""

    def __init__(self, routed: dict[str, Routed], placer: Placer, failover: Failover,
                 on_updates: Callable[[list[SequenceUpdate]], None], traffic: TrafficWindow | None = None) -> None:
        self._routed = routed
        self._placer = placer
        self._failover = failover
        self._on_updates = on_updates
        self._traffic = traffic
        self.trace: tuple[float, ...] = ()

    def on_tokens(self, handle: ActorHandle, msg: m.TokenUpdates) -> None:
        self.trace = (*msg.trace, time.monotonic()) if msg.trace else ()
        updates = []
        for row in msg.updates:
            routed = self._routed.get(row.request_id)
            if routed is None or routed.decode != handle.actor_id:
                continue  # a request this actor no longer owns (aborted, or failed over)
            self._observe(handle, routed, row)
            update = update_from_wire(row)
            if routed.migrations:  # what the first admission found cached, not what the resumed prefill found
                update = replace(update, num_cached_tokens=routed.cached_tokens)
            updates.append(update)
        if updates:
            self._on_updates(updates)

    def _observe(self, handle: ActorHandle, routed: Routed, row: m.TokenUpdate) -> None:
        """A colocated request's first token checks its estimate; a last sample's finish forgets it."""
        if not routed.streamed and routed.prefill is None and routed.placement is not None:
            self._placer.record_estimate(handle, routed.placement.estimated_ttft,
                                         time.monotonic() - routed.dispatched_at, routed.placement.uncached_tokens)
        if row.token_id is not None:
            if not routed.streamed:
                routed.cached_tokens = row.num_cached_tokens
                routed.first_token_at = time.monotonic()
            routed.streamed = True
            routed.emitted.setdefault(row.sample_index, []).append(row.token_id)
        if row.finish_reason is not None:
            routed.finished_samples.add(row.sample_index)
            if len(routed.finished_samples) >= routed.request.params.n:
                self._finished(routed)
                self._failover.forget(routed)

    def _finished(self, routed: Routed) -> None:
        """Its TTFT (from its arrival) and mean time per token after the first, for the elastic planner."""
        if self._traffic is None or routed.first_token_at is None:
            return
        req, now = routed.request, time.monotonic()
        tokens = len(routed.emitted.get(0, ()))
        tpot = (now - routed.first_token_at) / (tokens - 1) if tokens > 1 else None
        quadrant = self._traffic.classify(len(req.prompt_token_ids), req.params.max_tokens, req.treatment.long_prompt)
        self._traffic.completion(now, quadrant, routed.first_token_at - routed.arrived_at, tpot, tokens)
