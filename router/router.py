"""The router: the main process's engine client when the model runs in actor subprocesses.

It places each request (colocated on a decode actor, or prefill actor + KV hand-off), drives the hand-off
protocol, forwards token updates, and fails over when an actor dies: a request that has not streamed a
token is retried elsewhere, one that has ends with an error. Every reservation it asks for carries a
deadline, so a lost message can never pin blocks for longer than that.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from actors.convert import params_to_wire, update_from_wire
from actors.spec import ActorSpec
from actors.supervisor import ActorHandle, Supervisor, SupervisorSettings
from engine.engine_core import EngineRequest, EngineStats
from engine.scheduler import SequenceUpdate
from router.cost_model import ArrivalRate, DecodeCost, PrefillCost, Smoothed, TransferCost
from router.placement import (DISAGGREGATED, DecodeActorView, Placement, PlacementPolicy, PrefillActorView,
                              choose_decode_actor, place)
from transport import messages as m

log = logging.getLogger("router")

# Costs until calibration measures them (a 135M model on one CPU core, roughly).
DEFAULT_PREFILL = PrefillCost(fixed=0.01, per_token=0.002)
DEFAULT_DECODE = DecodeCost(fixed=0.03, per_seq=0.002)
SHM_TRANSFER = TransferCost(latency=0.001, bytes_per_second=float("inf"))  # written in place: no copy
# Pages streamed to a decode actor on another host, relayed by this process (measured on loopback by
# bench/kv_transfer.py: 0.24-0.47 GB/s; a real network is slower), until live transfers correct it.
TCP_TRANSFER = TransferCost(latency=0.005, bytes_per_second=2.5e8)
MIN_CORRECTION_TOKENS = 256  # shorter prompts do not correct the prefill cost curves (see _record_estimate)
STREAMS_AVERAGE_WEIGHT = 0.1  # EWMA of each decode actor's streams, sampled at every placement


@dataclass(frozen=True)
class RouterSettings:
    policy: PlacementPolicy = PlacementPolicy("auto")
    handoff_timeout: float = 30.0  # a reservation + prefill + commit must finish within this
    max_attempts: int = 3
    park_timeout: float = 60.0  # how long a request waits for a decode actor to come (back) up


@dataclass(eq=False)
class Routed:
    request: EngineRequest
    placement: Placement | None = None
    decode: str | None = None
    prefill: str | None = None
    phase: str = "parked"  # parked | reserving | prefilling | decoding
    streamed: bool = False
    attempts: int = 0
    finished_samples: set[int] = field(default_factory=set)
    parked_at: float = field(default_factory=time.monotonic)
    dispatched_at: float = 0.0


class RequestFailedError(RuntimeError):
    """The request could not be completed (after retries, or after tokens had already been streamed)."""


class ActorRouter:
    def __init__(self, specs: list[ActorSpec], on_updates: Callable[[list[SequenceUpdate]], None],
                 on_error: Callable[[str, Exception], None], settings: RouterSettings = RouterSettings(),
                 supervisor_settings: SupervisorSettings = SupervisorSettings()) -> None:
        self.settings = settings
        self._on_updates, self._on_error = on_updates, on_error
        self.supervisor = Supervisor(specs, self._on_message, self._on_up, self._on_down, supervisor_settings)
        self.routed: dict[str, Routed] = {}
        self._watchdog: asyncio.Task | None = None
        self._handlers = {m.TokenUpdates: self._on_tokens, m.BlocksReserved: self._on_reserved,
                          m.ReservationFailed: self._on_reservation_failed, m.KVReady: self._on_kv_ready,
                          m.RequestFailed: self._on_request_failed, m.Error: self._on_actor_error,
                          m.IntegrityReport: self._on_integrity_report, m.KVPages: self._on_kv_pages}
        self._integrity_waiters: dict[str, asyncio.Future] = {}
        self.corrections: dict[str, Smoothed] = {}  # actor -> observed / predicted prefill time
        self.estimate_errors: deque[float] = deque(maxlen=1024)  # |predicted - observed| / observed
        self.kv_bytes_transferred = 0
        self.kv_transfers = 0
        self.kv_bytes_streamed = 0  # of those, relayed over TCP to decode actors on other hosts
        self.streams_average: dict[str, float] = {}  # decode actor -> EWMA of its streams at placements
        self.arrivals = ArrivalRate()

    # ---------------------------------------------------------------- engine-client interface

    async def start(self, listen: tuple[str, int, bytes] | None = None) -> None:
        """Spawn the local actors; with `listen=(host, port, secret)` also accept workers from other hosts."""
        self.loop = asyncio.get_running_loop()
        await self.supervisor.start()
        if listen is not None:
            self.listen_address = await self.supervisor.listen_for_workers(*listen)
        elif not self.supervisor.ready("decode"):
            raise RuntimeError("no decode actor could start; see the actor logs above")
        self._watchdog = asyncio.create_task(self._watch())

    async def add(self, request: EngineRequest) -> Placement | None:
        if request.request_id in self.routed:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        routed = self.routed[request.request_id] = Routed(request)
        self.arrivals = self.arrivals.observe(time.monotonic())  # here, not in _place: a retry is no arrival
        return self._dispatch(routed)

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        routed = self.routed.get(request_id)
        if routed is None:
            return
        if sample_index is None or routed.request.params.n == 1:
            self._forget(routed)
        self._send(routed.decode, m.AbortRequest(request_id, sample_index))
        if routed.phase == "prefilling":
            self._send(routed.prefill, m.AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """Totals over the decode actors as of their last heartbeat (at most one interval old)."""
        decodes = self.supervisor.ready("decode")
        loads = [h.load for h in decodes if h.load is not None]
        total = lambda name: sum(getattr(x, name) for x in loads)  # noqa: E731
        per_token = max((h.ready.kv_export.get("bytes_per_token", 0) for h in decodes), default=0)
        return EngineStats(total("running"), total("waiting") + self._parked_count(), total("kv_total"),
                           total("kv_used"), total("kv_cached"), total("prefix_queries"), total("prefix_hits"),
                           total("preemptions"), total("spec_proposed"), total("spec_accepted"), total("spec_steps"),
                           kv_bytes_per_token=per_token, kv_blocks_compressed=total("kv_compressed"),
                           kv_blocks_cold_total=total("kv_cold_total"), kv_compressions=total("kv_compressions"))

    def actors(self) -> list[dict]:
        return [{"id": h.actor_id, "role": h.spec.role, "device": h.spec.device, "pid": h.pid, "state": h.state,
                 "restarts": h.restarts, "running": h.load.running if h.load else 0,
                 "kv_blocks": {"total": h.load.kv_total, "used": h.load.kv_used} if h.load else None}
                for h in self.supervisor.handles]

    def placement_of(self, request_id: str) -> Placement | None:
        routed = self.routed.get(request_id)
        return None if routed is None else routed.placement

    def can_serve(self) -> bool:
        return bool(self.supervisor.ready("decode"))

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

    async def close(self) -> None:
        """Fail every request in flight and stop the actors."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        for routed in list(self.routed.values()):
            self._fail(routed, "the server is shutting down")
        await self.supervisor.stop()

    # ---------------------------------------------------------------- placement and dispatch

    def _dispatch(self, routed: Routed) -> Placement | None:
        routed.attempts += 1
        placement = self._place(routed.request)
        if placement is None:
            routed.phase, routed.parked_at = "parked", time.monotonic()
            return None
        routed.placement, routed.decode = placement, placement.decode_actor
        routed.dispatched_at = time.monotonic()
        if placement.path == DISAGGREGATED and routed.request.params.n == 1:
            routed.prefill, routed.phase = placement.prefill_actor, "reserving"
            deadline = time.time() + self.settings.handoff_timeout
            self._send(routed.decode, m.ReserveBlocks(routed.request.request_id, routed.request.prompt_token_ids,
                                                       deadline))
        else:
            self._colocate(routed)
        return placement

    def _place(self, request: EngineRequest) -> Placement | None:
        decodes = self.supervisor.ready("decode")
        if not decodes:
            return None
        block_size = decodes[0].ready.block_size
        prompt = len(request.prompt_token_ids)
        views = {h.actor_id: self._decode_view(h, self.arrivals.rate / len(decodes)) for h in decodes}
        chosen = choose_decode_actor(list(views.values()), prompt, block_size) or min(
            views.values(), key=lambda v: v.running)  # none has room now: queue on the least loaded
        handle = self.supervisor.by_id(chosen.actor_id)
        transfer = SHM_TRANSFER if _mappable(handle) else TCP_TRANSFER
        prefills = [PrefillActorView(h.actor_id, self._prefill_cost(h), self._queued_prefill(h), transfer)
                    for h in self.supervisor.ready("prefill")]
        policy = self.settings.policy if prefills else PlacementPolicy("never")
        bytes_per_token = int(handle.ready.kv_export.get("bytes_per_token", 0))
        return place(policy, prompt, block_size, [chosen], prefills, bytes_per_token) \
            or place(PlacementPolicy("never"), 0, block_size, [chosen], [], bytes_per_token)

    def _decode_view(self, handle: ActorHandle, arrival_rate: float) -> DecodeActorView:
        """Block counts from the last heartbeat; streams and queued prompts from the router's own books,
        which are current (a burst's second request must see the first)."""
        load = handle.load
        free = handle.ready.num_kv_blocks - (load.kv_used if load else 0)
        streams, queued = self._decode_load(handle.actor_id)
        return DecodeActorView(handle.actor_id, self._expected_streams(handle.actor_id, streams), free, 0,
                               self._prefill_cost(handle), self._decode_cost(handle), queued, arrival_rate)

    @staticmethod
    def _decode_cost(handle: ActorHandle) -> DecodeCost:
        calib = handle.ready.calibration or {}
        return DecodeCost.fit(calib["decode"]) if calib.get("decode") else DEFAULT_DECODE

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
            if r.decode != actor_id or r.phase != "decoding":
                continue
            if r.streamed or r.prefill is not None:
                streams += r.request.params.n
            else:
                queued += len(r.request.prompt_token_ids)
        return streams, queued

    def _prefill_cost(self, handle: ActorHandle) -> PrefillCost:
        """Fitted from the actor's start-up calibration, scaled by what live traffic has shown since."""
        samples = (handle.ready.calibration or {}).get("prefill")
        base = PrefillCost.fit(samples) if samples else DEFAULT_PREFILL
        ratio = self.corrections.get(handle.actor_id, Smoothed()).ratio
        return PrefillCost(base.fixed * ratio, base.per_token * ratio, base.per_token_sq * ratio)

    def _queued_prefill(self, handle: ActorHandle) -> int:
        return sum(len(r.request.prompt_token_ids) for r in self.routed.values()
                   if r.prefill == handle.actor_id and r.phase in ("reserving", "prefilling"))

    def calibration(self) -> dict:
        """What /status shows: each actor's fitted costs and the live correction applied to them."""
        out = {}
        for h in self.supervisor.handles:
            if h.state != "ready" or h.spec.role == "draft":  # a draft actor neither prefills nor decodes
                continue
            cost = self._prefill_cost(h)
            entry = {"prefill_seconds_per_token": cost.per_token, "prefill_fixed_seconds": cost.fixed,
                     "prefill_seconds_per_token_sq": cost.per_token_sq, "prefill_seconds_512": cost.seconds(512),
                     "correction": self.corrections.get(h.actor_id, Smoothed()).ratio}
            if h.spec.role == "decode":
                decode = self._decode_cost(h)
                entry |= {"decode_step_fixed_seconds": decode.fixed, "decode_step_seconds_per_seq": decode.per_seq}
            out[h.actor_id] = entry
        return out

    def _record_estimate(self, handle: ActorHandle, predicted: float, observed: float,
                         uncached_tokens: int) -> None:
        """Check a prefill estimate against what happened: feeds the error metric and, for prompts long enough
        that compute dominates, the online correction. (The correction scales the whole curve: fed by short
        prompts, whose time is mostly fixed overhead, it doubled the predicted cost of long prompts.)"""
        if uncached_tokens >= MIN_CORRECTION_TOKENS:
            self.corrections[handle.actor_id] = self.corrections.get(handle.actor_id, Smoothed()).observe(
                predicted, observed)
        if observed > 0:
            self.estimate_errors.append(abs(predicted - observed) / observed)

    def _colocate(self, routed: Routed) -> None:
        routed.phase, routed.prefill = "decoding", None
        req = routed.request
        self._send(routed.decode, m.AddRequest(req.request_id, req.prompt_token_ids, params_to_wire(req.params),
                                               req.priority, req.arrival_time, speculate=req.speculate,
                                               compress_first=req.compress_first))

    # ---------------------------------------------------------------- messages from actors

    def _on_message(self, handle: ActorHandle, msg: m.Message) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from %s", type(msg).__name__, handle.actor_id)
            return
        handler(handle, msg)

    def _on_tokens(self, handle: ActorHandle, msg: m.TokenUpdates) -> None:
        updates = []
        for row in msg.updates:
            routed = self.routed.get(row.request_id)
            if routed is None or routed.decode != handle.actor_id:
                continue  # a request this actor no longer owns (aborted, or failed over)
            if not routed.streamed and routed.prefill is None and routed.placement is not None:
                self._record_estimate(handle, routed.placement.estimated_ttft,
                                      time.monotonic() - routed.dispatched_at, routed.placement.uncached_tokens)
            routed.streamed |= row.token_id is not None
            if row.finish_reason is not None:
                routed.finished_samples.add(row.sample_index)
                if len(routed.finished_samples) >= routed.request.params.n:
                    self._forget(routed)
            updates.append(update_from_wire(row))
        if updates:
            self._on_updates(updates)

    def _on_reserved(self, handle: ActorHandle, msg: m.BlocksReserved) -> None:
        routed = self._expect(msg.request_id, "reserving", handle)
        if routed is None:
            self._send(handle.actor_id, m.ReleaseReservation(msg.request_id))
            return
        routed.phase = "prefilling"
        req = routed.request
        block_size = handle.ready.block_size
        self._send(routed.prefill, m.PrefillRequest(req.request_id, req.prompt_token_ids, params_to_wire(req.params),
                                                    routed.decode, msg.block_ids, msg.num_cached_tokens // block_size,
                                                    time.time() + self.settings.handoff_timeout,
                                                    stream=not _mappable(handle),
                                                    kv_format=handle.ready.kv_export.get("kv_format", "auto")))

    def _on_kv_pages(self, handle: ActorHandle, msg: m.KVPages) -> None:
        """Relay a streamed hand-off's pages to the decode actor on another host (same connection, so they
        arrive before the AddRequest that KVReady triggers)."""
        routed = self.routed.get(msg.request_id)
        if routed is None or routed.phase != "prefilling" or routed.prefill != handle.actor_id:
            return
        self.kv_bytes_streamed += len(msg.payload)
        self._send(routed.decode, msg)

    def _on_reservation_failed(self, handle: ActorHandle, msg: m.ReservationFailed) -> None:
        routed = self._expect(msg.request_id, "reserving", handle)
        if routed is not None:
            log.info("reservation for %s failed (%s): colocating", msg.request_id, msg.reason)
            self._colocate(routed)

    def _on_kv_ready(self, handle: ActorHandle, msg: m.KVReady) -> None:
        routed = self.routed.get(msg.request_id)
        if routed is None or routed.phase != "prefilling" or routed.prefill != handle.actor_id:
            return
        routed.phase = "decoding"
        # Like for like: the placement's estimate (queue + prefill + transfer) against dispatch -> KV ready.
        if routed.placement is not None and routed.placement.disaggregated_cost is not None:
            self._record_estimate(handle, routed.placement.disaggregated_cost,
                                  time.monotonic() - routed.dispatched_at, routed.placement.uncached_tokens)
        self.kv_bytes_transferred += msg.num_bytes
        self.kv_transfers += 1
        req = routed.request
        self._send(routed.decode, m.AddRequest(
            req.request_id, req.prompt_token_ids, params_to_wire(req.params), req.priority, req.arrival_time,
            reserved_block_ids=[], first_token=msg.first_token, first_logprob=msg.logprob,
            first_top_logprobs=msg.top_logprobs, generator_state=msg.generator_state, checksum=msg.checksum,
            speculate=req.speculate, compress_first=req.compress_first))

    def _on_request_failed(self, handle: ActorHandle, msg: m.RequestFailed) -> None:
        routed = self.routed.get(msg.request_id)
        if routed is None:
            return
        log.warning("%s failed on %s: %s", msg.request_id, handle.actor_id, msg.reason)
        if handle.actor_id == routed.prefill and routed.phase == "prefilling":
            self._send(routed.decode, m.ReleaseReservation(msg.request_id))
            self._colocate(routed)
        elif msg.retryable and not routed.streamed:
            self._retry(routed, msg.reason)
        else:
            self._fail(routed, msg.reason)

    def _on_actor_error(self, handle: ActorHandle, msg: m.Error) -> None:
        log.error("actor %s reports: %s", handle.actor_id, msg.message)

    def _expect(self, request_id: str, phase: str, handle: ActorHandle) -> Routed | None:
        routed = self.routed.get(request_id)
        if routed is None or routed.phase != phase or routed.decode != handle.actor_id:
            return None
        return routed

    # ---------------------------------------------------------------- actors coming and going

    async def _on_up(self, handle: ActorHandle) -> None:
        if handle.spec.role == "decode" and _mappable(handle):
            for prefill in self.supervisor.ready("prefill"):
                await prefill.send(_attach(handle))
        elif handle.spec.role == "prefill":
            for decode in filter(_mappable, self.supervisor.ready("decode")):
                await handle.send(_attach(decode))
        self._unpark()

    async def _on_down(self, handle: ActorHandle) -> None:
        if handle.spec.role == "decode":
            for prefill in self.supervisor.ready("prefill"):
                await prefill.send(m.DetachPool(handle.actor_id))
        for routed in list(self.routed.values()):
            if routed.decode == handle.actor_id:
                self._decode_lost(routed)
            elif routed.prefill == handle.actor_id and routed.phase in ("reserving", "prefilling"):
                self._send(routed.decode, m.ReleaseReservation(routed.request.request_id))
                self._colocate(routed)

    def _decode_lost(self, routed: Routed) -> None:
        if routed.phase == "prefilling":
            self._send(routed.prefill, m.AbortRequest(routed.request.request_id))
        if routed.streamed:
            self._fail(routed, f"decode actor {routed.decode} died after streaming tokens")
        else:
            self._retry(routed, f"decode actor {routed.decode} died")

    def _retry(self, routed: Routed, reason: str) -> None:
        if routed.attempts >= self.settings.max_attempts:
            self._fail(routed, f"{reason} (after {routed.attempts} attempts)")
            return
        log.info("retrying %s elsewhere: %s", routed.request.request_id, reason)
        routed.decode = routed.prefill = None
        self._dispatch(routed)

    def _unpark(self) -> None:
        for routed in [r for r in self.routed.values() if r.phase == "parked"]:
            self._dispatch(routed)

    async def _watch(self) -> None:
        """Fail requests that waited too long for a decode actor, and retry parked ones when one is up."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for routed in [r for r in self.routed.values() if r.phase == "parked"]:
                if now - routed.parked_at > self.settings.park_timeout:
                    self._fail(routed, "no decode actor became available")
            if self.supervisor.ready("decode"):
                self._unpark()

    def _parked_count(self) -> int:
        return sum(r.phase == "parked" for r in self.routed.values())

    def _fail(self, routed: Routed, reason: str) -> None:
        self._forget(routed)
        self._on_error(routed.request.request_id, RequestFailedError(reason))

    def _forget(self, routed: Routed) -> None:
        self.routed.pop(routed.request.request_id, None)

    def _send(self, actor_id: str | None, msg: m.Message) -> None:
        if actor_id is None:
            return
        handle = self.supervisor.by_id(actor_id)
        asyncio.ensure_future(handle.send(msg))


def _mappable(decode: ActorHandle) -> bool:
    """Only a pool on this host (shared memory / CUDA IPC) can be written into by our prefill actors."""
    return decode.ready.kv_export.get("kind") in ("shm", "cuda_ipc")


def _attach(decode: ActorHandle) -> m.AttachPool:
    return m.AttachPool(decode.actor_id, decode.ready.kv_export, decode.ready.num_kv_blocks, decode.ready.block_size)
