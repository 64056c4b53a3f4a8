"""The router: the main process's engine client (engine.core.client_protocol.EngineClient) when the model runs in
actor subprocesses.

It wires the parts together: `placer` decides where each request runs, `handoff` drives a disaggregated
request through reservation, prefill and commit, `failover` retries, parks and fails requests as actors come
and go. This module owns the request table, routes the actors' messages to those parts and forwards token
updates. Every reservation carries a deadline, so a lost message never pins blocks for longer than that.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from actors.convert import update_from_wire
from actors.ray_options import RayOptions
from actors.spec import ActorSpec, Role
from actors.supervisor import ActorHandle, ActorState, Supervisor, SupervisorSettings
from engine.core.engine_core import EngineRequest
from engine.core.stats import EngineStats
from engine.core.step import SequenceUpdate
from router.failover import Failover
from router.handoff import Handoff, Phase, Routed, attachable, export_for
from router.placement import DISAGGREGATED, Placement, PlacementPolicy
from router.placer import Placer
from transport import messages as m

log = logging.getLogger("router")
LEAVING_SETTLE_SECONDS = 0.5  # after an actor's Leaving, how long to wait for the server's own stop signal

__all__ = ["ActorRouter", "RouterSettings"]


@dataclass(frozen=True)
class RouterSettings:
    policy: PlacementPolicy = PlacementPolicy("auto")
    handoff_timeout: float = 30.0  # a reservation + prefill + commit must finish within this
    max_attempts: int = 3
    park_timeout: float = 30.0  # how long a request waits for a decode actor to come (back) up
    max_migrations: int = 3  # times one stream may move to another decode actor before it ends with an error


class ActorRouter:
    def __init__(self, specs: list[ActorSpec], on_updates: Callable[[list[SequenceUpdate]], None],
                 on_error: Callable[[str, Exception], None], settings: RouterSettings = RouterSettings(),
                 supervisor_settings: SupervisorSettings = SupervisorSettings(), ray: RayOptions | None = None) -> None:
        self.settings = settings
        self._on_updates = on_updates
        self.supervisor = Supervisor(specs, self._on_message, self._on_up, self._on_down, supervisor_settings, ray)
        self.routed: dict[str, Routed] = {}
        self.placer = Placer(self.supervisor, self.routed, settings.policy)
        self.handoff = Handoff(self.routed, self._send, self.placer.record_estimate, settings.handoff_timeout,
                               self._handle_or_none, self.placer.record_transfer)
        self.failover = Failover(self.supervisor, self.routed, self.handoff, self._dispatch, on_error,
                                 settings.max_attempts, settings.park_timeout, settings.max_migrations)
        self._watchdog: asyncio.Task | None = None
        self._trace: tuple[float, ...] = ()  # the stamps of the token frame being delivered
        self._integrity_waiters: dict[str, asyncio.Future] = {}
        self._stopping = False  # the server is shutting down: actors that leave are neither drained nor replaced
        self._drains: set[asyncio.Task] = set()  # drains started by an actor's Leaving (held until done)
        self._handlers = {m.TokenUpdates: self._on_tokens, m.BlocksReserved: self.handoff.on_reserved,
                          m.ReservationFailed: self.handoff.on_reservation_failed,
                          m.KVReady: self.handoff.on_kv_ready, m.KVPages: self.handoff.on_kv_pages,
                          m.RequestFailed: self.failover.on_request_failed, m.Error: self._on_actor_error,
                          m.IntegrityReport: self._on_integrity_report, m.Leaving: self._on_leaving}

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

    async def add(self, request: EngineRequest) -> Placement | None:
        if request.request_id in self.routed:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        routed = self.routed[request.request_id] = Routed(request)
        self.placer.observe_arrival(time.monotonic())
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
                "failed_migrations": moved.failed_migrations}

    async def drain(self, actor_id: str) -> int:
        """Move every request off a prefill or decode actor while it still runs, then stop it; the supervisor
        starts a fresh one at once (a rolling restart). Returns the number of requests moved. KeyError for an
        unknown actor, ValueError for one that cannot be drained."""
        handle = self.supervisor.by_id(actor_id)
        if handle.spec.role is Role.DRAFT or handle.spec.remote:
            raise ValueError(f"actor {actor_id} is a {'remote' if handle.spec.remote else 'draft'} actor; only "
                             "local prefill and decode actors can be drained")
        if handle.state is not ActorState.READY or handle.draining:
            raise ValueError(f"actor {actor_id} is {'draining' if handle.draining else handle.state.value}")
        handle.draining = True  # placement skips it from now on
        moved = self.failover.move_off(handle)
        log.info("draining actor %s: %d requests moved", actor_id, moved, extra={"actor_id": actor_id})
        await handle.send(m.Shutdown())
        return moved

    def _on_leaving(self, handle: ActorHandle, msg: m.Leaving) -> None:
        """An actor got SIGTERM. When the whole server is stopping (a signal to the process group reaches every
        process at once) let it be; otherwise drain it, after a moment in which the server's own signal would
        have arrived."""
        async def drain_unless_stopping() -> None:
            await asyncio.sleep(LEAVING_SETTLE_SECONDS)
            if not self._stopping and handle.state is ActorState.READY and not handle.draining:
                await self.drain(handle.actor_id)

        log.info("actor %s was asked to stop", handle.actor_id, extra={"actor_id": handle.actor_id})
        task = asyncio.ensure_future(drain_unless_stopping())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    def begin_shutdown(self) -> None:
        """The server drains: actors that exit now (a signal to the whole process group) stay down, and
        actors that ask to leave are not drained."""
        self._stopping = True
        self.supervisor.begin_shutdown()

    async def close(self) -> None:
        """Fail every request in flight and stop the actors."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for routed in list(self.routed.values()):
            self.failover.fail(routed, "the server is shutting down")
        await self.supervisor.stop()

    # ---------------------------------------------------------------- counters and integrity

    @property
    def kv_bytes_transferred(self) -> int:
        return self.handoff.counters.kv_bytes_transferred

    @property
    def kv_transfers(self) -> int:
        return self.handoff.counters.kv_transfers

    @property
    def kv_bytes_streamed(self) -> int:
        return self.handoff.counters.kv_bytes_streamed

    async def check_integrity(self, actor_id: str, timeout: float = 10.0) -> m.IntegrityReport:
        """Ask one actor to verify its block pool; raises TimeoutError if it does not answer."""
        future = self._integrity_waiters[actor_id] = asyncio.get_running_loop().create_future()
        if not await self.supervisor.by_id(actor_id).send(m.CheckIntegrity()):
            raise ConnectionError(f"actor {actor_id} is not reachable")
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._integrity_waiters.pop(actor_id, None)

    def _on_integrity_report(self, handle: ActorHandle, msg: m.IntegrityReport) -> None:
        future = self._integrity_waiters.get(handle.actor_id)
        if future is not None and not future.done():
            future.set_result(msg)

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
        return self._trace

    def _on_tokens(self, handle: ActorHandle, msg: m.TokenUpdates) -> None:
        self._trace = (*msg.trace, time.monotonic()) if msg.trace else ()
        updates = []
        for row in msg.updates:
            routed = self.routed.get(row.request_id)
            if routed is None or routed.decode != handle.actor_id:
                continue  # a request this actor no longer owns (aborted, or failed over)
            self._observe_token(handle, routed, row)
            update = update_from_wire(row)
            if routed.migrations:  # what the first admission found cached, not what the resumed prefill found
                update = replace(update, num_cached_tokens=routed.cached_tokens)
            updates.append(update)
        if updates:
            self._on_updates(updates)

    def _observe_token(self, handle: ActorHandle, routed: Routed, row: m.TokenUpdate) -> None:
        """A colocated request's first token checks its estimate; a last sample's finish forgets it."""
        if not routed.streamed and routed.prefill is None and routed.placement is not None:
            self.placer.record_estimate(handle, routed.placement.estimated_ttft,
                                        time.monotonic() - routed.dispatched_at, routed.placement.uncached_tokens)
        if row.token_id is not None:
            if not routed.streamed:
                routed.cached_tokens = row.num_cached_tokens
            routed.streamed = True
            routed.emitted.setdefault(row.sample_index, []).append(row.token_id)
        if row.finish_reason is not None:
            routed.finished_samples.add(row.sample_index)
            if len(routed.finished_samples) >= routed.request.params.n:
                self.failover.forget(routed)

    def _on_actor_error(self, handle: ActorHandle, msg: m.Error) -> None:
        log.error("actor %s reports: %s", handle.actor_id, msg.message)

    # ---------------------------------------------------------------- actors coming and going

    async def _on_up(self, handle: ActorHandle) -> None:
        if handle.spec.role is Role.DECODE and attachable(handle):
            for prefill in self.supervisor.ready(Role.PREFILL):
                await _attach(handle, prefill)
        elif handle.spec.role is Role.PREFILL:
            for decode in filter(attachable, self.supervisor.ready(Role.DECODE)):
                await _attach(decode, handle)
        self.failover.unpark()

    async def _on_down(self, handle: ActorHandle) -> None:
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
