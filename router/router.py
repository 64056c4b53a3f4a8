"""The router: the main process's engine client (engine.core.client_protocol.EngineClient) when the model runs in
actor subprocesses.

It wires the parts together: `placer` decides where each request runs, `handoff` drives a disaggregated
request through reservation, prefill and commit, `failover` retries, parks and fails requests as actors come
and go, `delivery` forwards token updates, `drains` moves requests off an actor before it stops and
`integrity` asks an actor to check its block pool; `roles` changes an actor between prefill and decode, which
`degrade` does when the last decode actor is lost and `elastic` when its planner says a layout serves the traffic
better. This module owns the request table and routes the actors' messages to those parts. Every reservation
carries a deadline, so a lost message never pins blocks for longer than that.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from actors.ray_options import RayOptions
from actors.spec import ActorSpec, Role
from actors.supervisor import ActorHandle, ActorState, Supervisor, SupervisorSettings
from engine.core.engine_core import EngineRequest
from engine.core.stats import EngineStats
from engine.core.step import SequenceUpdate
from router.degrade import Degrade
from router.delivery import TokenDelivery
from router.drains import Drains
from router.elastic import Elastic
from router.elastic_settings import ElasticSettings
from router.failover import WATCH_SECONDS, Failover
from router.handoff import Handoff, Phase, Routed, attachable, export_for
from router.integrity import IntegrityChecks
from router.merges import CoreMerges
from router.placement import DISAGGREGATED, Placement, PlacementPolicy
from router.placer import Placer
from router.roles import RoleChanges
from router.traffic import TrafficWindow
from transport import messages as m

log = logging.getLogger("router")

__all__ = ["ActorRouter", "RouterSettings"]


@dataclass(frozen=True)
class RouterSettings:
    policy: PlacementPolicy = PlacementPolicy("auto")
    handoff_timeout: float = 30.0  # a reservation + prefill + commit must finish within this
    max_attempts: int = 3
    park_timeout: float = 30.0  # how long a request waits for a decode actor to come (back) up
    max_migrations: int = 3  # times one stream may move to another decode actor before it ends with an error
    elastic: ElasticSettings = ElasticSettings()  # the planner's targets, whether it may switch, degrading
    share_kv: bool = False  # decode actors export their pools (as the layout's do): set by a role change too


class ActorRouter:
    def __init__(self, specs: list[ActorSpec], on_updates: Callable[[list[SequenceUpdate]], None],
                 on_error: Callable[[str, Exception], None], settings: RouterSettings = RouterSettings(),
                 supervisor_settings: SupervisorSettings = SupervisorSettings(), ray: RayOptions | None = None) -> None:
        self.settings = settings
        self.supervisor = Supervisor(specs, self._on_message, self._on_up, self._on_down, supervisor_settings, ray)
        self.routed: dict[str, Routed] = {}
        self.placer = Placer(self.supervisor, self.routed, settings.policy)
        self.handoff = Handoff(self.routed, self._send, self.placer.record_estimate, settings.handoff_timeout,
                               self._handle_or_none, self.placer.record_transfer)
        self.failover = Failover(self.supervisor, self.routed, self.handoff, self._dispatch, on_error,
                                 settings.max_attempts, settings.park_timeout, settings.max_migrations)
        now, elastic = time.monotonic(), settings.elastic
        self.traffic = TrafficWindow(elastic, now)
        self.delivery = TokenDelivery(self.routed, self.placer, self.failover, on_updates, self.traffic)
        self.drains = Drains(self.supervisor, self.failover)
        self.integrity = IntegrityChecks(self.supervisor)
        self.roles = RoleChanges(self.supervisor, self.failover, self._role_changed, settings.share_kv,
                                 elastic.change_timeout, elastic.switch_seconds)
        self.merges = CoreMerges(self.supervisor, self.failover, self.roles, elastic.change_timeout)
        self.degrade = Degrade(self.supervisor, self.roles, elastic)
        self.elastic = Elastic(self.supervisor, self.roles, self.merges, self.placer, self.routed, self.traffic,
                               elastic, now)
        self._watchdog: asyncio.Task | None = None
        self._upkeep: asyncio.Task | None = None
        self._handlers = {m.TokenUpdates: self.delivery.on_tokens, m.BlocksReserved: self.handoff.on_reserved,
                          m.ReservationFailed: self.handoff.on_reservation_failed,
                          m.KVReady: self.handoff.on_kv_ready, m.KVPages: self.handoff.on_kv_pages,
                          m.RequestFailed: self.failover.on_request_failed, m.Error: self._on_actor_error,
                          m.IntegrityReport: self.integrity.on_report, m.Leaving: self.drains.on_leaving,
                          m.RoleChanged: self.roles.on_changed, m.CoresSet: self.merges.on_cores_set}

    # ---------------------------------------------------------------- EngineClient

    async def start(self, listen: tuple[str, int, bytes] | None = None) -> None:
        """Spawn the local actors; with `listen=(host, port, secret)` also accept workers from other hosts."""
        self.loop = asyncio.get_running_loop()
        await self.supervisor.start()
        if listen is not None:
            self.listen_address = await self.supervisor.listen_for_workers(*listen)
        elif not self.supervisor.ready(Role.DECODE):
            reasons = "; ".join(f"{h.actor_id}: {h.start_error}" for h in self.supervisor.handles
                                if h.spec.role is Role.DECODE and h.start_error)
            raise RuntimeError(f"no decode actor could start: {reasons}" if reasons else
                               "no decode actor could start; see the actor logs above")
        self._watchdog = asyncio.create_task(self.failover.watch())
        self._upkeep = asyncio.create_task(self._keep_layout())

    async def add(self, request: EngineRequest) -> Placement | None:
        if request.request_id in self.routed:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        routed = self.routed[request.request_id] = Routed(request)
        now = time.monotonic()
        self.placer.observe_arrival(now)
        self.traffic.arrival(now, len(request.prompt_token_ids), request.params.max_tokens,
                             request.treatment.long_prompt)
        return self._dispatch(routed)

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        routed = self.routed.get(request_id)
        if routed is None:
            return
        if sample_index is None or routed.request.params.n == 1:
            self.failover.forget(routed)
        self._send(routed.decode, m.AbortRequest(request_id, sample_index))
        if routed.phase is Phase.PREFILLING:
            self._send(routed.prefill, m.AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """Totals over the decode actors as of their last heartbeat (at most one interval old)."""
        decodes = self.supervisor.ready(Role.DECODE)
        total = EngineStats.total(h.load for h in decodes if h.load is not None)
        per_token = max((h.ready.kv_export.get("bytes_per_token", 0) for h in decodes), default=0)  # known at Ready
        return replace(total, waiting=total.waiting + self.failover.parked_count(), kv_bytes_per_token=per_token)

    def actors(self) -> list[dict]:
        return [{"id": h.actor_id, "role": h.spec.role, "device": h.spec.device, "pid": h.pid, "state": h.state,
                 "node": {"id": h.hello.node_id, "address": h.hello.node_address} if h.hello else None,
                 "restarts": h.restarts, "draining": h.draining, "last_exit": h.last_exit,
                 "running": h.load.running if h.load else 0,
                 "kv_blocks": {"total": h.load.kv_blocks_total, "used": h.load.kv_blocks_used} if h.load else None,
                 "backend": h.ready.backend if h.ready else None}
                for h in self.supervisor.handles]

    def calibration(self) -> dict:
        """What /status shows: each actor's fitted costs and the live correction applied to them, and under "links"
        the measured cost of each prefill -> decode link that has streamed pages."""
        costs = self.placer.calibration([h for h in self.supervisor.handles if h.state is ActorState.READY])
        return costs | ({"links": self.placer.link_costs()} if self.placer.links else {})

    def placement_of(self, request_id: str) -> Placement | None:
        routed = self.routed.get(request_id)
        return None if routed is None else routed.placement

    def can_serve(self) -> bool:
        return bool(self.supervisor.ready(Role.DECODE))

    def counters(self) -> dict[str, int]:
        """Cumulative router counters for /metrics: KV hand-offs and stream migrations."""
        c, moved = self.handoff.counters, self.failover.counters
        return {"kv_transfers": c.kv_transfers, "kv_bytes_transferred": c.kv_bytes_transferred,
                "migrations": moved.migrations, "migrated_tokens": moved.migrated_tokens,
                "failed_migrations": moved.failed_migrations, "role_changes": self.roles.changes,
                "failed_role_changes": self.roles.failures}

    def layout_status(self) -> dict:
        """What /status shows of the layout: the current one and the time spent in each, the planner's last
        decision with the predicted goodput of each candidate, the role changes, the merged cores, and the degraded
        stand-ins."""
        return self.elastic.status(time.monotonic()) | {"roles": self.roles.status(), "merges": self.merges.status(),
                                                        "degrade": self.degrade.status()}

    async def drain(self, actor_id: str) -> int:
        """Move every request off a prefill or decode actor, then stop it (router.drains)."""
        return await self.drains.drain(actor_id)

    def begin_shutdown(self) -> None:
        """The server drains: actors that exit now (a signal to the whole process group) stay down, and
        actors that ask to leave are not drained."""
        self.drains.stop()
        if self._upkeep is not None:  # no role changes while the actors stop
            self._upkeep.cancel()
        self.supervisor.begin_shutdown()

    async def close(self) -> None:
        """Fail every request in flight and stop the actors."""
        self.drains.stop()
        for task in (self._watchdog, self._upkeep):
            if task is not None:
                task.cancel()
        for routed in list(self.routed.values()):
            self.failover.fail(routed, "the server is shutting down")
        await self.supervisor.stop()

    # ---------------------------------------------------------------- dispatch and messages

    def _dispatch(self, routed: Routed) -> Placement | None:
        routed.attempts += 1
        placement = self.placer.place(routed.request)
        if placement is None:
            self.failover.park(routed)
            return None
        if routed.moved_from is not None:
            routed.moves += (f"{routed.moved_from}->{placement.decode_actor}",)
            routed.moved_from = None
        placement = replace(placement, moves=routed.moves)
        routed.placement, routed.decode = placement, placement.decode_actor
        routed.dispatched_at = time.monotonic()
        if placement.path == DISAGGREGATED and routed.request.params.n == 1:
            self.handoff.begin(routed)
        else:
            self.handoff.colocate(routed)
        return placement

    def _on_message(self, handle: ActorHandle, msg: m.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from %s", type(msg).__name__, handle.actor_id)
            return
        handler(handle, msg)

    def trace(self) -> tuple[float, ...]:
        """The stamps of the token frame being delivered."""
        return self.delivery.trace

    def _on_actor_error(self, handle: ActorHandle, msg: m.Error) -> None:
        log.error("actor %s reports: %s", handle.actor_id, msg.message)

    async def _keep_layout(self) -> None:
        """Degrade when the last decode actor is lost, and let the planner decide when a decision is due."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            now = time.monotonic()
            try:
                self.degrade.check(now)
                self.elastic.tick(now)
            except Exception:  # noqa: BLE001 - a bug here must not end the loop that degrades a lost decode role
                log.exception("keeping the layout failed")

    # ---------------------------------------------------------------- actors coming and going

    async def _on_up(self, handle: ActorHandle) -> None:
        if handle.spec.role is Role.DECODE and attachable(handle):
            for prefill in self.supervisor.ready(Role.PREFILL):
                await _attach(handle, prefill)
        elif handle.spec.role is Role.PREFILL:
            for decode in filter(attachable, self.supervisor.ready(Role.DECODE)):
                await _attach(decode, handle)
        self.failover.unpark()

    async def _role_changed(self, handle: ActorHandle) -> None:
        """An actor serves in its new role: the layout's clock turns, and its pools are attached as for an actor
        that came up."""
        self.elastic.tick(time.monotonic(), decide=False)
        await self._on_up(handle)

    async def _on_down(self, handle: ActorHandle) -> None:
        self.roles.on_down(handle)
        self.merges.on_down(handle)
        if handle.spec.role is Role.DECODE:
            for prefill in self.supervisor.ready(Role.PREFILL):
                await prefill.send(m.DetachPool(handle.actor_id))
        self.failover.on_down(handle)

    def _handle_or_none(self, actor_id: str | None) -> ActorHandle | None:
        try:
            return None if actor_id is None else self.supervisor.by_id(actor_id)
        except KeyError:
            return None

    def _send(self, actor_id: str | None, msg: m.Message) -> None:
        if actor_id is None:
            return
        handle = self.supervisor.by_id(actor_id)
        asyncio.ensure_future(handle.send(msg))


async def _attach(decode: ActorHandle, prefill: ActorHandle) -> None:
    """Tell a prefill actor how to reach a decode actor's pool: in place on its node, else its KV endpoint."""
    export = export_for(decode, prefill)
    if export is not None:
        await prefill.send(m.AttachPool(decode.actor_id, export, decode.ready.num_kv_blocks, decode.ready.block_size))
