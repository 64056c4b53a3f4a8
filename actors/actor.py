"""The actor base class: connections, message dispatch, heartbeats and lifecycle shared by every role.

An actor listens on its spec's Unix socket (or joins a server over TCP) before it loads its engine, greets every
connection with Hello, then StartupProgress each time its start moves on (actors/startup.py) until Ready, then
serves messages until Shutdown. The model step runs on an EngineThread so this loop stays responsive
(heartbeats, aborts) during long steps. Outputs go back on the connection that submitted the request. The roles
(decode_actor, prefill_actor, draft_actor) override the hooks marked below.

A prefill or decode actor may change role without a restart (actors/roles.py): the object the worker made keeps
the process (its socket, its connections, the dispatch of their messages), and `current` is the object that plays
the role now, itself until the first change, then one built for the new role around the same loaded model. Every
message is handed to the current object's handlers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any, Awaitable, Callable

from actors.cores import set_cores
from actors.spec import ActorSpec, Role, node_identity
from actors.startup import Startup, StartupRelay
from engine.core.engine_thread import EngineThread
from engine.core.stats import EngineStats
from transport import Connection, TransportError, connect_tcp, serve_unix
from transport import messages as m

log = logging.getLogger("actor")
RESERVATION_SWEEP_SECONDS = 0.25
LEAVE_SECONDS = 60.0  # after SIGTERM, how long an actor waits for the server to move its work and stop it


def to_monotonic(deadline: float | None, default_seconds: float = 30.0) -> float:
    """Wire deadlines are Unix times; engines compare against the monotonic clock."""
    remaining = default_seconds if deadline is None else deadline - time.time()
    return time.monotonic() + remaining


ChangeRole = Callable[["Actor", Connection, m.ChangeRole], Awaitable[None]]  # (the process's actor, ...)


class Actor:
    """Shared plumbing of every role: connections, dispatch, heartbeats, lifecycle."""

    def __init__(self, spec: ActorSpec, change_role: ChangeRole | None = None) -> None:
        self.spec = spec
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: EngineThread | None = None
        self.current: Actor = self  # the object playing the process's role now (see the module's docstring)
        self.change_role = change_role  # how this process changes role (actors/roles.py); None: it cannot
        self.loaded: Any = None  # a role change's engine.core.builder.LoadedModel: build around it, load nothing
        self.tasks: list[asyncio.Task] = []  # the role's background tasks (start_tasks), cancelled when it ends
        self.changing = False  # the process is changing role (actors/roles.py)
        self.owners: dict[str, Connection] = {}  # request id -> connection that submitted it
        self.stopped = asyncio.Event()
        self.draining = False
        self.connections: set[Connection] = set()
        self._parent = os.getppid()
        self._leaving = False
        self.startup = Startup()  # the worker replaces it with one that starts at the process's creation
        self.relay = StartupRelay(spec.actor_id)  # build_engine passes relay.report down as its progress

    # ---------------------------------------------------------------- overridden per role
    def build_engine(self) -> Any:
        """Load (and calibrate) the engine, reporting its stages through `self.relay.report`. Runs on a thread of
        its own (build_in_thread), not the loop's."""

    def start_tasks(self) -> None:
        """Start the role's background tasks on the loop (kept in `tasks`), once the engine is built."""

    def ready_message(self) -> m.Ready: ...

    def handlers(self) -> dict[type, Callable]: ...

    def deliver(self, outputs: list) -> None: ...

    async def on_joined(self, conn: Connection, secret: bytes) -> None:
        """Joined a server on another host over `conn`, before Hello and Ready go out on it."""

    def stats(self) -> EngineStats:
        """What the next heartbeat reports (read on this thread, without stopping a step)."""
        return EngineStats()

    # ---------------------------------------------------------------- lifecycle
    async def run(self) -> None:
        """Serve on the spec's Unix socket (spawned by a local supervisor), listening from before the engine
        loads: the supervisor hears how the start goes (StartupProgress) and gives up only on silence."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)
        server = await serve_unix(self.spec.socket_path, self.serve_connection)
        self.startup.mark("listen")
        try:
            if await self._start_engine():
                await self.stopped.wait()
        finally:
            await server.close()
            self._stop_engine()

    async def run_connected(self, host: str, port: int, secret: bytes) -> None:
        """Join a server on another host over authenticated TCP, reconnecting until told to shut down; it joins
        while the engine loads, and reports its progress there as on a Unix socket."""
        starting = asyncio.ensure_future(self._start_engine())
        try:
            while not self.stopped.is_set() and self.relay.ready is not False:
                try:
                    conn = await connect_tcp(host, port, secret)
                except (TransportError, OSError, TimeoutError) as exc:
                    log.warning("cannot reach %s:%s (%s); retrying", host, port, exc)
                    await asyncio.sleep(1.0)
                    continue
                log.info("actor %s joined %s:%s", self.spec.actor_id, host, port)
                await self.on_joined(conn, secret)
                await self.serve_connection(conn)
            await starting  # its error, when the engine failed to build
        finally:
            starting.cancel()
            self._stop_engine()

    def _on_sigterm(self) -> None:
        """Asked to stop. A prefill or decode actor serving a server tells it (Leaving), so that its requests
        move elsewhere before the server stops it with Shutdown. It stops at once on a second signal, when
        its server is gone (this is then the parent-death signal), and by itself after LEAVE_SECONDS."""
        if self._leaving or os.getppid() != self._parent or not self.connections \
                or self.current.spec.role not in (Role.DECODE, Role.PREFILL):
            self.stopped.set()
            return
        self._leaving = True
        log.info("SIGTERM: asking the server to move this actor's requests before it stops")
        leaving = m.Leaving(self.spec.actor_id, time.time() + LEAVE_SECONDS)
        for conn in list(self.connections):
            asyncio.ensure_future(send_quietly(conn, leaving))
        asyncio.get_running_loop().call_later(LEAVE_SECONDS, self.stopped.set)

    async def _start_engine(self) -> bool:
        """Build the engine off the loop, then start stepping and let waiting connections have Ready; False when
        the actor was stopped first. The build's error is raised here."""
        self.loop = asyncio.get_running_loop()
        engine = await self.relay.build(self.build_engine, self.stopped, f"{self.spec.actor_id}-build")
        if engine is None:
            return False
        self.thread = EngineThread(engine, self.loop, self.deliver, self._on_step_error, name=self.spec.actor_id)
        self.start_tasks()
        self.startup.mark("other")
        log.info("actor %s (%s) ready on %s in %.2fs (%s)", self.spec.actor_id, self.spec.role,
                 self.spec.socket_path or "its TCP connection", self.startup.total, self.startup.summary(),
                 extra={"startup": self.startup.rounded()})
        self.relay.finish(True)
        return True

    def _stop_engine(self) -> None:
        current = self.current
        if current.thread is not None:
            current.thread.shutdown()
        current.release()

    def release(self) -> None:
        """Free process-external resources (shared memory) on the way out."""

    async def serve_connection(self, conn: Connection) -> None:
        node_id, node_address = node_identity()
        try:
            await conn.send(m.Hello(self.current.spec.role.value, self.spec.device, os.getpid(), self.spec.actor_id,
                                    node_id=node_id, node_address=node_address))
            if not await self.relay.until_ready(conn):
                return  # the engine will not serve (its build failed, or the actor stops)
            await conn.send(self.current.ready_message())
            self.connections.add(conn)
            await self._dispatch_messages(conn)
        except (TransportError, ConnectionError, OSError):
            pass  # the peer left or sent garbage: this connection ends, the actor goes on
        finally:
            self.connections.discard(conn)
            current = self.current
            for rid in [rid for rid, owner in current.owners.items() if owner is conn]:
                current.on_owner_lost(rid)
            conn.close()

    async def _dispatch_messages(self, conn: Connection) -> None:
        process = {m.Heartbeat: self.on_heartbeat, m.Shutdown: self.on_shutdown, m.Drain: self.on_drain,
                   m.CheckIntegrity: self.on_check_integrity,
                   m.SetCores: lambda conn, msg: _on_set_cores(self, conn, msg)}
        if self.change_role is not None:
            process[m.ChangeRole] = lambda conn, msg: self.change_role(self, conn, msg)
        playing, handlers = None, process
        in_flight: set[asyncio.Task] = set()
        try:
            async for msg in conn:
                if playing is not self.current:  # the role changed since the last message
                    playing, handlers = self.current, self.current.handlers() | process
                handler = handlers.get(type(msg))
                if handler is None:
                    await conn.send(m.Error(f"{playing.spec.role} actor does not handle {type(msg).__name__}"))
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
        await conn.send(m.HeartbeatAck(msg.seq, msg.time, self.current.stats()))

    async def on_check_integrity(self, conn: Connection, msg: m.CheckIntegrity) -> None:
        current = self.current
        await conn.send(await current.thread.submit(current.integrity_report))

    def integrity_report(self, engine: Any) -> m.IntegrityReport:
        return m.IntegrityReport(self.spec.actor_id, None, 0, 0, 0, len(self.owners))

    async def on_shutdown(self, conn: Connection, msg: m.Shutdown) -> None:
        self.stopped.set()

    async def on_drain(self, conn: Connection, msg: m.Drain) -> None:
        self.current.draining = True

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


async def _on_set_cores(process: Actor, conn: Connection, msg: m.SetCores) -> None:
    """Run on other cores from the next step on (actors/cores.py)."""
    current = process.current
    await send_quietly(conn, await set_cores(process.spec.actor_id, current.thread, process.changing, msg))


async def send_quietly(conn: Connection, msg: m.Message) -> None:
    """Send, ignoring a connection that is already gone."""
    try:
        await conn.send(msg)
    except (TransportError, ConnectionError, OSError):
        pass

