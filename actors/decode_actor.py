"""The decode actor: an EngineCore whose KV pool lives in shared memory, serving colocated requests and
prefilled hand-offs (reserve blocks, receive the prefill, then decode)."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable
from functools import partial

import torch

from actors.actor import RESERVATION_SWEEP_SECONDS, Actor, ChangeRole, integrity_error, send_quietly, to_monotonic
from actors.convert import logprobs_from_wire, params_from_wire, resume_from_wire, update_to_wire
from engine.core.builder import build_engine_core
from engine.kv.export import SharedPool, create_shared_pool
from actors.remote_proposer import RemoteProposer
from actors.spec import ActorSpec
from engine.core.calibration import calibrate_engine, warm_up
from engine.core.calibration_store import start_calibration
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, EngineRequest, RequestError
from engine.core.stats import EngineStats
from transport import Connection
from transport import messages as m
from transport.kv_stream import KVStreamServer

log = logging.getLogger("actor")


def _retryable(exc: Exception) -> bool:
    return not isinstance(exc, RequestError) or exc.param == "kv"


def _refused(exc: Exception) -> str | None:
    """The field an invalid request's refusal names; None for a failure that is not the request's fault."""
    return exc.param if isinstance(exc, RequestError) and not _retryable(exc) else None


STREAM_WRITE_MARGIN = 1.0  # seconds before a reservation's deadline after which its pages are refused


@dataclass
class _StreamedReservation:
    block_ids: frozenset[int]  # the reserved blocks pages may be written into
    deadline: float  # monotonic
    written: int = 0  # page bytes written into them so far
    refused: str | None = None  # why some pages were not written


class DecodeActor(Actor):
    """Owns an EngineCore whose KV pool lives in shared memory: colocated requests and prefilled hand-offs."""

    def __init__(self, spec: ActorSpec, change_role: ChangeRole | None = None) -> None:
        super().__init__(spec, change_role)
        self.pool: SharedPool | None = None
        self.engine: EngineCore | None = None
        # Hand-offs whose pages arrive from another host, written by the loop (relayed KVPages) or by the KV
        # endpoint's threads (direct streams). `_streams_lock` is held for each check-and-write and for each
        # removal, so no page lands in a block after its reservation is forgotten here; the engine frees a
        # reservation's blocks only after that (release, abort, admission, expiry by the sweep).
        self.streams: dict[str, _StreamedReservation] = {}
        self._streams_lock = threading.Lock()
        self.kv_endpoint: KVStreamServer | None = None

    def build_engine(self) -> EngineCore:
        # A pool that takes hand-offs (shared, or streamed to a worker on another host) keeps the plain layout
        options = dict(self.spec.engine, free_window_kv=False) if self.spec.share_kv or self.spec.remote \
            else self.spec.engine
        config = EngineConfig(**options)

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            self.pool = create_shared_pool(shape, dtype, self.spec.local_device, tag=self.spec.actor_id,
                                           assume_free=config.shm_free_bytes)
            if self.spec.pool_socket:
                self.pool.serve(self.spec.pool_socket)
            return self.pool.tensor

        # Only prefill actors write into the pool; peers on another host cannot map our memory, but on a Ray
        # node the actors placed beside this one can.
        shared = self.spec.share_kv and (self.spec.ray or not self.spec.remote)
        with self.startup.stage("engine"):
            # The server checked that its actors fit in this host's memory; a worker on another host checks itself
            self.engine = build_engine_core(config, device=self.spec.local_device,
                                            kv_allocator=allocate if shared else None, proposer=self._draft_client(),
                                            progress=self.relay.report, check_memory=self.spec.remote,
                                            loaded=self.loaded)
        with self.startup.stage("calibration"):
            self.calibration = start_calibration(self.engine, self.spec.calibration,
                                                 partial(calibrate_engine, progress=self.relay.report),
                                                 partial(warm_up, progress=self.relay.report), log)
        return self.engine

    def start_tasks(self) -> None:
        self.tasks.append(self.loop.create_task(self._sweep_reservations()))

    def _draft_client(self) -> RemoteProposer | None:
        """Drafts from the spec's draft actor instead of a draft model in this process, when it names one."""
        return RemoteProposer(self.spec.draft_socket, self.spec.local_device) if self.spec.draft_socket else None

    def ready_message(self) -> m.Ready:
        kv = self.engine.kv_cache
        export = dict(self.pool.export if self.pool else {"kind": "none"}, bytes_per_token=kv.bytes_per_token,
                      kv_format=kv.kv_format)
        if self.engine.scheduler.tiers is not None:  # for the router's estimate of what admission will load
            export["kv_tiers"] = self.engine.scheduler.tiers.describe()
        if self.kv_endpoint is not None:
            host, port = self.kv_endpoint.address
            export["endpoint"] = [host, port]
            if self.pool is None:
                export.update(kind="tcp", host=host, port=port)
        return m.Ready(self.spec.actor_id, kv.num_blocks, kv.block_size, export, self.calibration.to_wire(),
                       self.engine.runner.backend.describe(), self.engine.config.max_num_batched_tokens)

    def release(self) -> None:
        """Hand the KV tiers what the pool caches (the engine steps no more), then close the KV endpoint and the
        exported pool (its mapping goes with the engine)."""
        if self.engine is not None:
            self.engine.close()
        if self.kv_endpoint is not None:
            self.kv_endpoint.close()
        if self.pool is not None:
            self.pool.close()
        self.kv_endpoint = self.pool = None

    async def on_joined(self, conn: Connection, secret: bytes) -> None:
        """Joined a server on another host: offer the KV endpoint that its prefill actors stream pages to, on
        the address this host reached it from (or the spec's `kv_listen`; "off" keeps pages relayed)."""
        if self.kv_endpoint is not None or self.spec.kv_listen == "off":
            return
        host, port = (conn.local_address[0], 0) if not self.spec.kv_listen else _host_port(self.spec.kv_listen)
        self.kv_endpoint = KVStreamServer(host, port, secret, self)
        log.info("KV endpoint for streamed hand-offs on %s:%s", *self.kv_endpoint.address)

    # ---- the KV endpoint's sink (transport.kv_stream.PageSink), called on its connection threads
    def page_bytes(self, layer: int, block_ids: list[int]) -> int:
        kv = self.engine.kv_cache
        if not 0 <= layer < kv.data.shape[0] or any(not 0 <= b < kv.num_blocks for b in block_ids):
            raise ValueError(f"layer {layer} or a block id outside the pool")
        return len(block_ids) * kv.bytes_per_layer_block

    def write(self, request_id: str, layer: int, block_ids: list[int], payload: memoryview) -> None:
        with self._streams_lock:
            self._write_locked(request_id, layer, block_ids, payload)

    def finish(self, request_id: str) -> tuple[int, str | None]:
        with self._streams_lock:
            stream = self.streams.get(request_id)
            if stream is None:
                return 0, "no live reservation for these pages (released or expired)"
            return stream.written, stream.refused

    def _write_locked(self, request_id: str, layer: int, block_ids: list[int],
                      payload: bytes | memoryview) -> None:
        stream = self.streams.get(request_id)
        if stream is None or time.monotonic() > stream.deadline - STREAM_WRITE_MARGIN \
                or not stream.block_ids.issuperset(block_ids):
            log.warning("dropping KV pages for %s: no live reservation holds those blocks", request_id,
                        extra={"request_id": request_id})
            if stream is not None:
                stream.refused = "pages came too late or for blocks the reservation does not hold"
            return
        try:
            self.engine.kv_cache.write_pages(layer, block_ids, payload)
            stream.written += len(payload)
        except ValueError as exc:  # the checksum at admission then refuses the hand-off
            stream.refused = str(exc)
            log.warning("dropping malformed KV pages for %s: %s", request_id, exc, extra={"request_id": request_id})

    def _forget_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self.streams.pop(request_id, None)

    def handlers(self) -> dict[type, Callable]:
        return {m.AddRequest: self.on_add, m.AbortRequest: self.on_abort, m.ReserveBlocks: self.on_reserve,
                m.ReleaseReservation: self.on_release, m.KVPages: self.on_kv_pages}

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def on_add(self, conn: Connection, msg: m.AddRequest) -> None:
        if self.draining:
            await conn.send(m.RequestFailed(msg.request_id, "actor is draining", True))
            return
        req = EngineRequest(msg.request_id, msg.prompt_token_ids, params_from_wire(msg.sampling), msg.priority,
                            time.monotonic(), treatment=msg.treatment,
                            resume=resume_from_wire(msg.resume))
        self.owners[msg.request_id] = conn
        self._forget_stream(msg.request_id)  # its pages are all in: nothing more may be written
        try:
            if req.params.guide is not None:  # compiled off both the loop and the step thread
                await asyncio.to_thread(self.engine.prepare_request, req)
            await self.thread.submit(lambda engine: self.thread.emit(self._admit(engine, req, msg)))
        except Exception as exc:  # an invalid request is final; a failed hand-off may run elsewhere
            self.owners.pop(msg.request_id, None)
            await conn.send(m.RequestFailed(msg.request_id, str(exc), _retryable(exc), _refused(exc)))

    @staticmethod
    def _admit(engine: EngineCore, req: EngineRequest, msg: m.AddRequest) -> list:
        if not msg.prefilled:
            engine.add_request(req)
            return []
        logprobs = logprobs_from_wire(msg.first_token, msg.first_logprob, msg.first_top_logprobs)
        return engine.add_prefilled_request(req, msg.first_token, logprobs, msg.checksum)

    async def on_abort(self, conn: Connection, msg: m.AbortRequest) -> None:
        self._forget_stream(msg.request_id)
        self.thread.post_outputs(lambda engine: engine.abort_request(msg.request_id, msg.sample_index))

    async def on_reserve(self, conn: Connection, msg: m.ReserveBlocks) -> None:
        deadline = to_monotonic(msg.deadline)
        try:
            blocks, cached = await self.thread.submit(
                lambda engine: engine.reserve_remote_prefill(msg.request_id, msg.prompt_token_ids, deadline))
        except Exception as exc:
            await conn.send(m.ReservationFailed(msg.request_id, str(exc)))
            return
        if self.spec.remote:  # only a decode actor on another host gets its pages as KVPages
            fresh = blocks[cached // self.engine.kv_cache.block_size:]
            with self._streams_lock:
                self.streams[msg.request_id] = _StreamedReservation(frozenset(fresh), deadline)
        await conn.send(m.BlocksReserved(msg.request_id, blocks, cached))

    async def on_kv_pages(self, conn: Connection, msg: m.KVPages) -> None:
        """Pages of a hand-off from another host, relayed by the router (no direct stream). Written at once:
        the blocks are reserved for this request, so no step reads them, and a reservation is forgotten (under
        the same lock) before the engine may free its blocks (release, abort, admission, or
        STREAM_WRITE_MARGIN before its deadline), so late or foreign pages never land in someone else's."""
        with self._streams_lock:
            self._write_locked(msg.request_id, msg.layer, msg.block_ids, msg.payload)

    async def on_release(self, conn: Connection, msg: m.ReleaseReservation) -> None:
        self._forget_stream(msg.request_id)
        self.thread.post(lambda engine: engine.cancel_remote_prefill(msg.request_id))

    def on_owner_lost(self, request_id: str) -> None:
        super().on_owner_lost(request_id)
        self._forget_stream(request_id)
        self.thread.post_outputs(lambda engine: engine.abort_request(request_id))

    def abort_everything(self, engine: EngineCore) -> None:
        engine.abort_all()

    def integrity_report(self, engine: EngineCore) -> m.IntegrityReport:
        pool = engine.pool
        return m.IntegrityReport(self.spec.actor_id, integrity_error(pool), pool.num_used, pool.num_cached,
                                 len(pool.reservations.owners()), len(engine.scheduler.running))

    def deliver(self, outputs: list) -> None:
        by_owner: dict[int, tuple[Connection, list]] = {}
        done = set()
        for update in outputs:
            conn = self.owners.get(update.request_id)
            if conn is not None:
                by_owner.setdefault(id(conn), (conn, []))[1].append(update_to_wire(update))
            if update.request_finished:  # as the step saw it: the engine may be steps further on by now
                done.add(update.request_id)  # every sample has finished: forgotten once this step's rows are out
        for request_id in done:
            self.owners.pop(request_id, None)
        trace = [self.thread.step_done_at, time.monotonic()] if self.spec.trace else None
        for conn, rows in by_owner.values():
            asyncio.ensure_future(send_quietly(conn, m.TokenUpdates(rows, trace)))

    async def _sweep_reservations(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(RESERVATION_SWEEP_SECONDS)
            now = time.monotonic()
            with self._streams_lock:  # before the engine may free them: no page is written after this
                for rid in [rid for rid, s in self.streams.items() if now > s.deadline - STREAM_WRITE_MARGIN]:
                    del self.streams[rid]
            self.thread.post(lambda engine: engine.expire_remote_prefills(now))


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)

