"""The actor process: `python -m actors.worker --spec JSON`.

Lifecycle: load the model and export the KV pool, listen on the spec's Unix socket, greet every connection
with Hello + Ready, then serve messages until Shutdown. The model step runs on an EngineThread so this loop
stays responsive (heartbeats, aborts) during long steps. Outputs go back on the connection that submitted
the request.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from actors.convert import logprobs_from_wire, logprobs_to_wire, params_from_wire, update_to_wire
from actors.kv_export import SharedPool, create_shared_pool, open_shared_pool
from actors.remote_proposer import RemoteProposer
from actors.spec import ActorSpec
from engine.calibration import calibrate_engine, calibrate_prefill_engine
from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineRequest, RequestError
from engine.engine_thread import EngineThread
from engine.kv_cache import KVCache
from engine.prefill_engine import PrefillEngine, PrefillJob, PrefillResult
from transport import Connection, TransportError, connect_tcp, load_secret, serve_unix
from transport import messages as m

log = logging.getLogger("actor")
RESERVATION_SWEEP_SECONDS = 0.25


def to_monotonic(deadline: float | None, default_seconds: float = 30.0) -> float:
    """Wire deadlines are Unix times; engines compare against the monotonic clock."""
    remaining = default_seconds if deadline is None else deadline - time.time()
    return time.monotonic() + remaining


class Actor:
    """Shared plumbing of both roles: connections, dispatch, heartbeats, lifecycle."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: EngineThread | None = None
        self.owners: dict[str, Connection] = {}  # request id -> connection that submitted it
        self.stopped = asyncio.Event()
        self.draining = False

    # ---------------------------------------------------------------- overridden per role
    def build_engine(self) -> Any: ...

    def ready_message(self) -> m.Ready: ...

    def handlers(self) -> dict[type, Callable]: ...

    def deliver(self, outputs: list) -> None: ...

    def load(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0, "kv_used": 0, "kv_total": 0}

    # ---------------------------------------------------------------- lifecycle
    async def run(self) -> None:
        """Serve on the spec's Unix socket (spawned by a local supervisor)."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.stopped.set)
        self._start_engine()
        server = await serve_unix(self.spec.socket_path, self.serve_connection)
        log.info("actor %s (%s) ready on %s", self.spec.actor_id, self.spec.role, self.spec.socket_path)
        try:
            await self.stopped.wait()
        finally:
            await server.close()
            self._stop_engine()

    async def run_connected(self, host: str, port: int, secret: bytes) -> None:
        """Join a server on another host over authenticated TCP, reconnecting until told to shut down."""
        self._start_engine()
        try:
            while not self.stopped.is_set():
                try:
                    conn = await connect_tcp(host, port, secret)
                except (TransportError, OSError, TimeoutError) as exc:
                    log.warning("cannot reach %s:%s (%s); retrying", host, port, exc)
                    await asyncio.sleep(1.0)
                    continue
                log.info("actor %s joined %s:%s", self.spec.actor_id, host, port)
                await self.serve_connection(conn)
        finally:
            self._stop_engine()

    def _start_engine(self) -> None:
        self.loop = asyncio.get_running_loop()
        engine = self.build_engine()
        self.thread = EngineThread(engine, self.loop, self.deliver, self._on_step_error, name=self.spec.actor_id)

    def _stop_engine(self) -> None:
        self.thread.shutdown()
        self.release()

    def release(self) -> None:
        """Free process-external resources (shared memory) on the way out."""

    async def serve_connection(self, conn: Connection) -> None:
        await conn.send(m.Hello(self.spec.role, self.spec.device, os.getpid(), self.spec.actor_id))
        await conn.send(self.ready_message())
        try:
            await self._dispatch_messages(conn)
        except (TransportError, ConnectionError, OSError):
            pass  # the peer left or sent garbage: this connection ends, the actor goes on
        finally:
            for rid in [rid for rid, owner in self.owners.items() if owner is conn]:
                self.on_owner_lost(rid)
            conn.close()

    async def _dispatch_messages(self, conn: Connection) -> None:
        handlers = self.handlers() | {m.Heartbeat: self.on_heartbeat, m.Shutdown: self.on_shutdown,
                                      m.Drain: self.on_drain, m.CheckIntegrity: self.on_check_integrity}
        in_flight: set[asyncio.Task] = set()
        try:
            async for msg in conn:
                handler = handlers.get(type(msg))
                if handler is None:
                    await conn.send(m.Error(f"{self.spec.role} actor does not handle {type(msg).__name__}"))
                    continue
                # A task per message: a handler waiting for the engine thread (which answers between steps)
                # must not hold up heartbeats or aborts behind it. Engine calls still run in arrival order,
                # because each handler queues its call before its first await.
                task = asyncio.create_task(handler(conn, msg))
                in_flight.add(task)
                task.add_done_callback(_reap(in_flight))
        finally:
            for task in in_flight:
                task.cancel()

    def on_owner_lost(self, request_id: str) -> None:
        """The router that submitted a request went away: nobody will read its output."""
        self.owners.pop(request_id, None)

    async def on_heartbeat(self, conn: Connection, msg: m.Heartbeat) -> None:
        await conn.send(m.HeartbeatAck(msg.seq, msg.time, **self.load()))

    async def on_check_integrity(self, conn: Connection, msg: m.CheckIntegrity) -> None:
        await conn.send(await self.thread.submit(self.integrity_report))

    def integrity_report(self, engine: Any) -> m.IntegrityReport:
        return m.IntegrityReport(self.spec.actor_id, None, 0, 0, 0, len(self.owners))

    async def on_shutdown(self, conn: Connection, msg: m.Shutdown) -> None:
        self.stopped.set()

    async def on_drain(self, conn: Connection, msg: m.Drain) -> None:
        self.draining = True

    def send_to_owner(self, request_id: str, msg: m.Message, finished: bool = False) -> None:
        conn = self.owners.pop(request_id, None) if finished else self.owners.get(request_id)
        if conn is not None and not conn.closed:
            asyncio.ensure_future(send_quietly(conn, msg))

    def _on_step_error(self, exc: BaseException) -> None:
        log.error("step failed: %s; failing every request", exc)
        for rid in list(self.owners):
            self.send_to_owner(rid, m.RequestFailed(rid, f"engine step failed: {exc}", False), finished=True)
        self.thread.post(self.abort_everything)

    def abort_everything(self, engine: Any) -> None: ...


def _reap(tasks: set[asyncio.Task]) -> Callable[[asyncio.Task], None]:
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("message handler failed: %r", task.exception())

    return done


def integrity_error(pool: Any) -> str | None:
    """What a block pool's check_integrity() finds wrong, or None."""
    try:
        pool.check_integrity()
    except AssertionError as exc:
        return str(exc)
    return None


def _retryable(exc: Exception) -> bool:
    return not isinstance(exc, RequestError) or exc.param == "kv"


async def send_quietly(conn: Connection, msg: m.Message) -> None:
    """Send, ignoring a connection that is already gone."""
    try:
        await conn.send(msg)
    except (TransportError, ConnectionError, OSError):
        pass


STREAM_WRITE_MARGIN = 1.0  # seconds before a reservation's deadline after which its pages are refused


@dataclass(frozen=True)
class _StreamedReservation:
    block_ids: frozenset[int]  # the reserved blocks pages may be written into
    deadline: float  # monotonic


class DecodeActor(Actor):
    """Owns an EngineCore whose KV pool lives in shared memory: colocated requests and prefilled hand-offs."""

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.pool: SharedPool | None = None
        self.engine: EngineCore | None = None
        self.streams: dict[str, _StreamedReservation] = {}  # hand-offs whose pages arrive as KVPages

    def build_engine(self) -> EngineCore:
        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            self.pool = create_shared_pool(shape, dtype, self.spec.local_device, tag=self.spec.actor_id)
            return self.pool.tensor

        shared = not self.spec.remote  # peers on another host cannot map our memory
        self.engine = EngineCore(EngineConfig(**self.spec.engine), device=self.spec.local_device,
                                 kv_allocator=allocate if shared else None, proposer=self._draft_client())
        self.calibration = calibrate_engine(self.engine)
        log.info("calibrated: %s", self.calibration)
        self.loop.create_task(self._sweep_reservations())
        return self.engine

    def _draft_client(self) -> RemoteProposer | None:
        """Drafts from the spec's draft actor instead of a draft model in this process, when it names one."""
        return RemoteProposer(self.spec.draft_socket, self.spec.local_device) if self.spec.draft_socket else None

    def ready_message(self) -> m.Ready:
        kv = self.engine.kv_cache
        export = dict(self.pool.export if self.pool else {"kind": "none"}, bytes_per_token=kv.bytes_per_token,
                      kv_format=kv.kv_format)
        return m.Ready(self.spec.actor_id, kv.num_blocks, kv.block_size, export, self.calibration.to_wire())

    def release(self) -> None:
        if self.pool is not None:
            self.pool.unlink()

    def handlers(self) -> dict[type, Callable]:
        return {m.AddRequest: self.on_add, m.AbortRequest: self.on_abort, m.ReserveBlocks: self.on_reserve,
                m.ReleaseReservation: self.on_release, m.KVPages: self.on_kv_pages}

    def load(self) -> dict[str, int]:
        s = self.engine.stats()
        return {"running": s.running, "waiting": s.waiting, "kv_used": s.kv_blocks_used,
                "kv_total": s.kv_blocks_total, "kv_cached": s.kv_blocks_cached, "prefix_queries": s.prefix_queries,
                "prefix_hits": s.prefix_hits, "preemptions": s.num_preemptions, "spec_proposed": s.spec_proposed,
                "spec_accepted": s.spec_accepted, "spec_steps": s.spec_steps, "kv_compressed": s.kv_blocks_compressed,
                "kv_cold_total": s.kv_blocks_cold_total, "kv_compressions": s.kv_compressions}

    async def on_add(self, conn: Connection, msg: m.AddRequest) -> None:
        if self.draining:
            await conn.send(m.RequestFailed(msg.request_id, "actor is draining", True))
            return
        req = EngineRequest(msg.request_id, msg.prompt_token_ids, params_from_wire(msg.sampling), msg.priority,
                            time.monotonic(), speculate=msg.speculate, compress_first=msg.compress_first)
        self.owners[msg.request_id] = conn
        self.streams.pop(msg.request_id, None)  # its pages are all in: nothing more may be written
        try:
            await self.thread.submit(lambda engine: self.thread.emit(self._admit(engine, req, msg)))
        except Exception as exc:  # an invalid request is final; a failed hand-off may run elsewhere
            self.owners.pop(msg.request_id, None)
            await conn.send(m.RequestFailed(msg.request_id, str(exc), _retryable(exc)))

    @staticmethod
    def _admit(engine: EngineCore, req: EngineRequest, msg: m.AddRequest) -> list:
        if msg.reserved_block_ids is None:
            engine.add_request(req)
            return []
        logprobs = logprobs_from_wire(msg.first_token, msg.first_logprob, msg.first_top_logprobs)
        return engine.add_prefilled_request(req, msg.first_token, logprobs, msg.generator_state, msg.checksum)

    async def on_abort(self, conn: Connection, msg: m.AbortRequest) -> None:
        self.streams.pop(msg.request_id, None)
        self.thread.post(lambda engine: engine.abort_request(msg.request_id, msg.sample_index))

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
            self.streams[msg.request_id] = _StreamedReservation(frozenset(fresh), deadline)
        await conn.send(m.BlocksReserved(msg.request_id, blocks, cached))

    async def on_kv_pages(self, conn: Connection, msg: m.KVPages) -> None:
        """Pages of a hand-off from another host. Written here on the loop thread, at once: the blocks are
        reserved for this request, so no step reads them, and a reservation is forgotten on this thread
        before the engine may free its blocks (release, abort, admission, or STREAM_WRITE_MARGIN before its
        deadline), so late or foreign pages never land in blocks that someone else may own."""
        stream = self.streams.get(msg.request_id)
        if stream is None or time.monotonic() > stream.deadline - STREAM_WRITE_MARGIN \
                or not stream.block_ids.issuperset(msg.block_ids):
            log.warning("dropping KV pages for %s: no live reservation holds those blocks", msg.request_id)
            return
        try:
            self.engine.kv_cache.write_pages(msg.layer, msg.block_ids, msg.payload)
        except ValueError as exc:  # the checksum at admission then refuses the hand-off
            log.warning("dropping malformed KV pages for %s: %s", msg.request_id, exc)

    async def on_release(self, conn: Connection, msg: m.ReleaseReservation) -> None:
        self.streams.pop(msg.request_id, None)
        self.thread.post(lambda engine: engine.cancel_remote_prefill(msg.request_id) and None)

    def on_owner_lost(self, request_id: str) -> None:
        super().on_owner_lost(request_id)
        self.streams.pop(request_id, None)
        self.thread.post(lambda engine: engine.abort_request(request_id))

    def abort_everything(self, engine: EngineCore) -> None:
        engine.abort_all()

    def integrity_report(self, engine: EngineCore) -> m.IntegrityReport:
        pool = engine.pool
        return m.IntegrityReport(self.spec.actor_id, integrity_error(pool), pool.num_used, pool.num_cached,
                                 len(pool.reserved_owners()), len(engine.scheduler.running))

    def deliver(self, outputs: list) -> None:
        by_owner: dict[int, tuple[Connection, list]] = {}
        for update in outputs:
            conn = self.owners.get(update.request_id)
            if conn is not None:
                by_owner.setdefault(id(conn), (conn, []))[1].append(update_to_wire(update))
            if update.finish_reason is not None and update.request_id not in self.engine.scheduler.by_request:
                self.owners.pop(update.request_id, None)  # every sample of the request has finished
        for conn, rows in by_owner.values():
            asyncio.ensure_future(send_quietly(conn, m.TokenUpdates(rows)))

    async def _sweep_reservations(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(RESERVATION_SWEEP_SECONDS)
            self.thread.post(lambda engine: engine.expire_remote_prefills(time.monotonic()) and None)


class PrefillActor(Actor):
    """Runs prompts straight into attached decode actors' pools and reports the first token."""

    def build_engine(self) -> PrefillEngine:
        self.engine = PrefillEngine(EngineConfig(**self.spec.engine), device=self.spec.local_device)
        self.calibration = calibrate_prefill_engine(self.engine)
        log.info("calibrated: %s", self.calibration)
        self.loop.create_task(self._sweep_deadlines())
        return self.engine

    def ready_message(self) -> m.Ready:
        return m.Ready(self.spec.actor_id, 0, self.engine.config.block_size, {"kind": "none"},
                       self.calibration.to_wire())

    def handlers(self) -> dict[type, Callable]:
        return {m.PrefillRequest: self.on_prefill, m.AbortRequest: self.on_abort, m.AttachPool: self.on_attach,
                m.DetachPool: self.on_detach}

    def load(self) -> dict[str, int]:
        return {"running": len(self.engine.jobs), "waiting": 0, "kv_used": 0, "kv_total": 0}

    async def on_attach(self, conn: Connection, msg: m.AttachPool) -> None:
        storage = open_shared_pool(msg.kv_export)
        cfg = self.engine.source.config
        kv = KVCache.from_export(cfg, msg.num_blocks, msg.block_size, storage, msg.kv_export, self.engine.dtype)
        self.thread.post(lambda engine: engine.attach_pool(msg.actor_id, kv))

    async def on_detach(self, conn: Connection, msg: m.DetachPool) -> None:
        dropped = await self.thread.submit(lambda engine: engine.detach_pool(msg.actor_id))
        for rid in dropped:
            self.send_to_owner(rid, m.RequestFailed(rid, f"{msg.actor_id} went away", True), finished=True)

    async def on_prefill(self, conn: Connection, msg: m.PrefillRequest) -> None:
        job = PrefillJob(msg.request_id, msg.prompt_token_ids, params_from_wire(msg.sampling), msg.dest_block_ids,
                         msg.skip_blocks * self.engine.config.block_size, msg.dest_actor_id,
                         to_monotonic(msg.deadline))
        self.owners[msg.request_id] = conn
        try:
            if msg.stream:
                await self.thread.submit(lambda engine: engine.add_streamed(job, msg.kv_format))
            else:
                await self.thread.submit(lambda engine: engine.add(job))
        except Exception as exc:
            self.owners.pop(msg.request_id, None)
            await conn.send(m.RequestFailed(msg.request_id, str(exc), True))

    async def on_abort(self, conn: Connection, msg: m.AbortRequest) -> None:
        self.owners.pop(msg.request_id, None)
        self.thread.post(lambda engine: engine.abort(msg.request_id) and None)

    def on_owner_lost(self, request_id: str) -> None:
        super().on_owner_lost(request_id)
        self.thread.post(lambda engine: engine.abort(request_id) and None)

    def abort_everything(self, engine: PrefillEngine) -> None:
        for rid in list(engine.jobs):
            engine.abort(rid)

    def deliver(self, outputs: list[PrefillResult]) -> None:
        for res in outputs:
            for layer, payload in enumerate(res.pages or ()):  # sent in order, before KVReady
                self.send_to_owner(res.request_id, m.KVPages(res.request_id, layer, res.dest_block_ids, payload))
            logprob, top = logprobs_to_wire(res.logprobs)
            msg = m.KVReady(res.request_id, res.first_token, logprob, top, res.num_bytes, res.checksum,
                            res.num_cached_tokens, res.generator_state)
            self.send_to_owner(res.request_id, msg, finished=True)

    async def _sweep_deadlines(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(RESERVATION_SWEEP_SECONDS)
            late = await self.thread.submit(lambda engine: engine.expire())
            for rid in late:
                self.send_to_owner(rid, m.RequestFailed(rid, "prefill missed its deadline", True), finished=True)


ACTOR_CLASSES = {"decode": DecodeActor, "prefill": PrefillActor}


def actor_class(role: str) -> type[Actor]:
    if role == "draft":
        from actors.draft_actor import DraftActor  # it builds on this module

        return DraftActor
    return ACTOR_CLASSES[role]


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: get SIGTERM (a clean stop that removes the shared pool) if the server process dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        log.warning("cannot tie this actor's life to its parent; it must be stopped explicitly")
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actors.worker")
    parser.add_argument("--spec", required=True, help="ActorSpec as JSON")
    parser.add_argument("--connect", default=None, help="HOST:PORT of a server to join over TCP")
    parser.add_argument("--secret-file", default=None, help="shared secret (else $PHASE_SERVE_SECRET)")
    args = parser.parse_args(argv)
    spec = ActorSpec.from_json(args.spec)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s {spec.actor_id} %(levelname)s %(message)s")
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if not spec.remote:
        _die_with_parent()
    torch.set_num_threads(spec.threads)
    try:
        import uvloop
        actor = actor_class(spec.role)(spec)
        if args.connect is None:
            uvloop.run(actor.run())
        else:
            host, port = args.connect.rsplit(":", 1)
            uvloop.run(actor.run_connected(host, int(port), load_secret(args.secret_file)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
