"""Start, watch and restart actor processes from the main process.

Each actor is a fresh interpreter (`python -m actors.worker`, never a fork of this torch-importing process)
listening on a socket in a private directory. The supervisor connects, reads Hello, then the actor's progress
(StartupProgress) until Ready, then heartbeats it. A start fails on silence, not on a total time: when the actor
sends nothing for `start_silence` seconds (actors/start_watch.py), or its process exits. An actor that exits,
closes its connection or misses heartbeats is killed, reported down (the router fails over its requests) and
restarted with exponential back-off; too many restarts in a short window is a crash loop, reported and not
retried.

With Ray options (`serve --ray`) the actors are Ray actors instead (actors.ray_actors): each joins over TCP
like a remote worker, Ray's report of its death counts like a process exit, and its restart is a new Ray
actor in the same bundle of the layout's placement group.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from engine.kv.export import reclaim_stale_pools
from engine.kv.host_tier import HostTierDir
from actors.ray_options import RayOptions
from actors.spec import ROLES, ActorSpec, Role, socket_name
from actors.start_watch import DEFAULT_START_SILENCE, StartSilence, StartWatch, await_ready, until_joined
from engine.core.stats import EngineStats
from transport import Connection, TransportError, connect_unix, private_socket_dir, serve_tcp
from transport.owned import owned_prefix, reclaim
from transport import messages as m

if TYPE_CHECKING:
    from actors.ray_actors import RayCluster

log = logging.getLogger("supervisor")


@dataclass(frozen=True)
class SupervisorSettings:
    # A starting actor that sends nothing (no progress) for this long is given up; a start has no total limit
    start_silence: float = DEFAULT_START_SILENCE
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    # Delay before restart k within the crash-loop window: the first replacement starts at once (its streams
    # wait for it), later ones back off.
    restart_backoff: tuple[float, ...] = (0.0, 1.0, 2.0, 4.0, 8.0)
    crash_loop_restarts: int = 5  # restarts within crash_loop_window that mean "give up"
    crash_loop_window: float = 120.0
    drain_exit_timeout: float = 10.0  # a drained actor told to shut down must exit within this


class ActorState(StrEnum):
    """An actor process as the supervisor sees it; `failed` (crash-looping) is never restarted."""

    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"
    FAILED = "failed"


@dataclass(eq=False)
class ActorHandle:
    spec: ActorSpec
    state: ActorState = ActorState.STARTING
    process: asyncio.subprocess.Process | None = None
    conn: Connection | None = None
    ready: m.Ready | None = None
    hello: m.Hello | None = None  # who it said it is, and on which node
    ray: Any = None  # on Ray: the running actor (actors.ray_actors.Launched)
    joined: asyncio.Future | None = None  # on Ray: resolves when the actor joined (Hello + Ready)
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)
    last_ack: float = 0.0
    load: EngineStats | None = None  # as of the last heartbeat
    tasks: list[asyncio.Task] = field(default_factory=list)
    incarnation: int = 0  # bumps at every (re)start, so stale events of an old process are ignored
    start_error: str | None = None  # why its last start failed, in the actor's words when it gave them
    draining: bool = False  # being drained (router.drain): no new work, and its exit is a planned restart
    changing_role: Role | None = None  # changing to this role (router.roles): no new work until it has
    parked: bool = False  # its cores are lent to a widened peer (router.merges): no new work until it gets them back
    widened: tuple[int, ...] | None = None  # the cores it runs on, its parked peers' among them (router.merges)
    last_exit: int | None = None  # the exit status of its previous process (negative: killed by that signal)
    down_at: float | None = None  # monotonic time it went down, until its replacement is ready
    watch: StartWatch | None = None  # its latest start: what it reported, and when it last did

    @property
    def actor_id(self) -> str:
        return self.spec.actor_id

    @property
    def pid(self) -> int | None:
        if self.process is not None:
            return self.process.pid
        return None if self.hello is None else self.hello.pid

    async def send(self, msg: m.Message) -> bool:
        """False when the actor is not reachable (the router then treats it as down)."""
        if self.state is not ActorState.READY or self.conn is None or self.conn.closed:
            return False
        try:
            await self.conn.send(msg)
            return True
        except (TransportError, ConnectionError, OSError):
            return False


def share_host_tier(specs: list[ActorSpec]) -> tuple[HostTierDir | None, list[ActorSpec]]:
    """The host KV tier the actors of this host share (engine/kv/host_tier.py): made here, so that this process
    owns it and removes it when it stops, when any actor asks for one; each such actor's spec names it."""
    sizes = [s.engine["kv_host_size"] for s in specs if s.engine.get("kv_host_size")]
    if not sizes:
        return None, specs
    tier = HostTierDir.create(max(sizes), specs[0].engine.get("shm_free_bytes"))
    return tier, [replace(s, engine=dict(s.engine, kv_host_dir=str(tier.path))) if s.engine.get("kv_host_size")
                  else s for s in specs]


OnMessage = Callable[[ActorHandle, m.Message], None]
OnChange = Callable[[ActorHandle], Awaitable[None] | None]


class Supervisor:
    def __init__(self, specs: list[ActorSpec], on_message: OnMessage, on_up: OnChange, on_down: OnChange,
                 settings: SupervisorSettings = SupervisorSettings(), ray: RayOptions | None = None) -> None:
        self.settings = settings
        self._ray_options = ray
        self.cluster: RayCluster | None = None
        self._join: tuple[tuple[str, int], bytes] | None = None  # where and with what secret Ray actors join
        reclaim(Path(tempfile.gettempdir()), SOCKET_DIR_KIND)  # what servers killed with SIGKILL left
        reclaim_stale_pools()
        self.host_tier, specs = share_host_tier(specs)
        self.socket_dir = private_socket_dir(owned_prefix(SOCKET_DIR_KIND))
        self.handles = [ActorHandle(replace(s, socket_path=str(self.socket_dir / socket_name(s.actor_id))))
                        for s in specs]
        self._on_message, self._on_up, self._on_down = on_message, on_up, on_down
        self._stopping = False
        self._tcp = None

    async def start(self) -> None:
        """Start every actor and wait until each is ready (or has failed to start). On Ray, a cluster that
        cannot be reached or cannot place the layout raises actors.ray_actors.RayUnavailable first."""
        if self._ray_options is not None:
            await self._open_ray(self._ray_options)
        await asyncio.gather(*(self._start(h) for h in self.handles))

    async def _open_ray(self, options: RayOptions) -> None:
        os.environ.update(options.environment())  # Ray reads it once, at its import
        from actors.ray_actors import RayCluster  # only here: without --ray nothing imports Ray

        self.cluster = RayCluster(options, [h.spec for h in self.handles if h.spec.ray])
        await self.cluster.open()
        secret = secrets.token_hex(32).encode()
        self._join = (await self.listen_for_workers(self.cluster.server_host(), 0, secret), secret)

    def begin_shutdown(self) -> None:
        """The server is stopping: an actor that exits from now on is not restarted."""
        self._stopping = True

    async def stop(self, grace: float = 5.0) -> None:
        """Stops every actor; the socket directory and the host tier go even when stopping one of them fails."""
        self._stopping = True
        try:
            await asyncio.gather(*(self._stop(h, grace) for h in self.handles))
            if self._tcp is not None:
                await self._tcp.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            if self.host_tier is not None:
                self.host_tier.close()

    async def listen_for_workers(self, host: str, port: int, secret: bytes) -> tuple[str, int]:
        """Accept actors on other hosts (`cli.py worker --connect HOST:PORT`) over authenticated TCP."""
        self._tcp = await serve_tcp(host, port, secret, self._accept_remote)
        return self._tcp.address

    async def _accept_remote(self, conn: Connection) -> None:
        hello = await conn.recv(timeout=self.settings.start_silence)
        if not isinstance(hello, m.Hello) or hello.role not in ROLES:
            raise TransportError("a remote worker must open with Hello")
        _check_version(hello)
        handle = self._remote_handle(hello)
        if handle.watch is None or not handle.spec.ray:  # a Ray actor's watch began when it was launched
            handle.watch = StartWatch(handle.actor_id, self.settings.start_silence)
        handle.watch.heard()
        ready = await await_ready(lambda timeout: conn.recv(timeout=timeout), handle.watch)
        if not handle.spec.ray:  # a Ray actor's incarnation began when it was launched
            handle.incarnation += 1
        handle.conn, handle.ready, handle.hello = conn, ready, hello
        handle.state, handle.last_ack = ActorState.READY, time.monotonic()
        incarnation = handle.incarnation
        watchers = handle.tasks if handle.spec.ray else []  # a Ray actor's keeps its launch's watch
        handle.tasks = [*watchers, asyncio.create_task(self._heartbeat(handle, incarnation))]
        if handle.joined is not None and not handle.joined.done():
            handle.joined.set_result(None)
        log.info("remote actor %s (%s) joined from %s (node %s)", handle.actor_id, hello.role, conn.peer,
                 hello.node_address or hello.node_id)
        await _maybe_await(self._on_up(handle))
        await self._read(handle, incarnation)

    def _remote_handle(self, hello: m.Hello) -> ActorHandle:
        for handle in self.handles:
            if handle.actor_id == hello.actor_id:
                if handle.state is ActorState.READY or not handle.spec.remote:
                    raise TransportError(f"actor id {hello.actor_id!r} is already taken")
                return handle
        handle = ActorHandle(ActorSpec(hello.actor_id, hello.role, hello.device, remote=True))
        self.handles.append(handle)
        return handle

    def kill(self, actor_id: str, sig: int = signal.SIGKILL) -> None:
        """Send a signal to an actor's process (tests and operators use this for failure drills); a Ray actor
        is killed through Ray, whatever the signal."""
        handle = self.by_id(actor_id)
        if handle.ray is not None:
            self.cluster.kill(handle.ray)
        elif handle.process is not None and handle.process.returncode is None:
            handle.process.send_signal(sig)

    def by_id(self, actor_id: str) -> ActorHandle:
        """KeyError for an actor this supervisor does not have."""
        for handle in self.handles:
            if handle.actor_id == actor_id:
                return handle
        raise KeyError(actor_id)

    def ready(self, role: Role) -> list[ActorHandle]:
        """The actors of `role` that take new work (ready, neither draining, changing role nor parked)."""
        return [h for h in self.handles if h.spec.role == role and h.state is ActorState.READY and not h.draining
                and h.changing_role is None and not h.parked]

    # ---------------------------------------------------------------- start / stop

    async def _start(self, handle: ActorHandle) -> None:
        if handle.spec.ray:
            await self._start_on_ray(handle)
            return
        handle.incarnation += 1
        handle.state = ActorState.STARTING
        Path(handle.spec.socket_path).unlink(missing_ok=True)
        Path(handle.spec.error_path).unlink(missing_ok=True)
        handle.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actors.worker", "--spec", handle.spec.to_json(),
            env=handle.spec.child_environment(), cwd=_project_root(), stdin=asyncio.subprocess.DEVNULL)
        handle.watch = StartWatch(handle.actor_id, self.settings.start_silence)
        try:
            await self._handshake(handle)
        except (asyncio.TimeoutError, TransportError, ConnectionError, OSError) as exc:
            handle.start_error = await self._start_failure(handle, exc)
            log.error("actor %s failed to start: %s", handle.actor_id, handle.start_error)
            await self._mark_down(handle, handle.incarnation)
            return
        handle.state, handle.last_ack, handle.start_error = ActorState.READY, time.monotonic(), None
        incarnation = handle.incarnation
        handle.tasks = [asyncio.create_task(self._read(handle, incarnation)),
                        asyncio.create_task(self._heartbeat(handle, incarnation)),
                        asyncio.create_task(self._watch_exit(handle, incarnation))]
        await self._serving(handle)

    async def _serving(self, handle: ActorHandle) -> None:
        """The actor is ready: say so (and how long it was down, for a replacement), and tell the router."""
        if handle.down_at is None:
            log.info("actor %s ready (pid %s)", handle.actor_id, handle.pid)
        else:
            back = time.monotonic() - handle.down_at
            log.info("actor %s serving again (pid %s), %.2fs after it went down", handle.actor_id, handle.pid, back,
                     extra={"actor_id": handle.actor_id, "seconds_down": round(back, 3)})
            handle.down_at = None
        await _maybe_await(self._on_up(handle))

    async def _handshake(self, handle: ActorHandle) -> None:
        """Hello, then the actor's progress until Ready, each within the silence window of the one before."""
        conn = await self._connect(handle)
        try:
            hello = await conn.recv(timeout=max(handle.watch.remaining(), 0.0))
            if not isinstance(hello, m.Hello):
                raise TransportError(f"expected Hello, got {type(hello).__name__}")
            _check_version(hello)
            handle.watch.heard()
            ready = await await_ready(lambda timeout: conn.recv(timeout=timeout), handle.watch)
        except TimeoutError as exc:
            conn.close(abort=True)
            raise exc if isinstance(exc, StartSilence) else handle.watch.silent() from None
        except BaseException:
            conn.close(abort=True)
            raise
        handle.conn, handle.ready, handle.hello = conn, ready, hello

    async def _start_failure(self, handle: ActorHandle, exc: BaseException) -> str:
        """Why a start failed: the actor's own words when its process ended (it writes them on the way out),
        with how far it had come."""
        if handle.process is not None and not isinstance(exc, StartSilence) \
                and await _exits_within(handle.process, START_EXIT_SECONDS):
            reason = _read_start_error(handle.spec)
            return (f"pid {handle.pid} {describe_exit(handle.process.returncode)} while starting, at "
                    f"{handle.watch.where()}" + (f": {reason}" if reason else ""))
        return str(exc) or type(exc).__name__

    async def _start_on_ray(self, handle: ActorHandle) -> None:
        """Launch the actor on Ray and wait until it joins; Ray's report of its end counts as its exit."""
        handle.incarnation += 1
        incarnation = handle.incarnation
        handle.state, handle.hello = ActorState.STARTING, None
        handle.joined = asyncio.get_running_loop().create_future()
        handle.ray = self.cluster.launch(handle.spec, *self._join)
        handle.watch = StartWatch(handle.actor_id, self.settings.start_silence)
        handle.tasks = [asyncio.create_task(self._watch_ray(handle, incarnation, handle.ray))]
        try:
            await until_joined(handle.joined, handle.watch)
        except (asyncio.TimeoutError, TransportError) as exc:
            handle.start_error = str(exc) or type(exc).__name__
            log.error("actor %s failed to start on Ray: %s", handle.actor_id, handle.start_error)
            await self._mark_down(handle, incarnation)
            return
        handle.start_error = None
        await self._serving(handle)

    async def _watch_ray(self, handle: ActorHandle, incarnation: int, launched: Any) -> None:
        """Wait for the Ray actor's run() to end: RayActorError when it (or its node) died."""
        try:
            status = await launched.finished()
            how = f"its Ray actor ended (status {status})"
        except Exception as exc:  # noqa: BLE001 - ray.exceptions.RayActorError and its kin: all mean it is gone
            how = f"its Ray actor died: {type(exc).__name__}"
        if handle.incarnation != incarnation:
            return
        if handle.joined is not None and not handle.joined.done():
            handle.joined.set_exception(TransportError(how))
        elif handle.state is ActorState.READY:
            log.error("actor %s: %s", handle.actor_id, how)
            await self._mark_down(handle, incarnation)

    async def _connect(self, handle: ActorHandle) -> Connection:
        """The actor listens once its imports are done, before it loads its model: poll for the socket while the
        process lives and the silence window lasts."""
        while True:
            if handle.process.returncode is not None:
                raise TransportError(f"pid {handle.pid} {describe_exit(handle.process.returncode)} while starting")
            if handle.watch.remaining() <= 0:
                raise handle.watch.silent()
            if Path(handle.spec.socket_path).exists():
                try:
                    return await connect_unix(handle.spec.socket_path, timeout=5.0)
                except (ConnectionError, OSError):
                    pass
            await asyncio.sleep(0.05)

    async def _stop(self, handle: ActorHandle, grace: float) -> None:
        for task in handle.tasks:
            task.cancel()
        await handle.send(m.Shutdown())
        handle.state = ActorState.DEAD
        if handle.ray is not None:
            await _ray_stops_within(handle.ray, grace)
            self.cluster.kill(handle.ray)
        if handle.process is not None and handle.process.returncode is None:
            try:
                await asyncio.wait_for(handle.process.wait(), grace)
            except asyncio.TimeoutError:
                handle.process.kill()
                await handle.process.wait()

    # ---------------------------------------------------------------- watching

    async def _read(self, handle: ActorHandle, incarnation: int) -> None:
        try:
            async for msg in handle.conn:
                if isinstance(msg, m.HeartbeatAck):
                    handle.last_ack, handle.load = time.monotonic(), msg.stats
                else:
                    self._on_message(handle, msg)
        except (TransportError, ConnectionError, OSError) as exc:
            log.warning("actor %s connection failed: %s", handle.actor_id, exc)
        await self._mark_down(handle, incarnation)

    async def _heartbeat(self, handle: ActorHandle, incarnation: int) -> None:
        seq = 0
        while handle.incarnation == incarnation and handle.state is ActorState.READY:
            seq += 1
            await handle.send(m.Heartbeat(seq, time.time()))
            await asyncio.sleep(self.settings.heartbeat_interval)
            if time.monotonic() - handle.last_ack > self.settings.heartbeat_timeout:
                log.error("actor %s missed heartbeats for %.1fs", handle.actor_id, self.settings.heartbeat_timeout)
                await self._mark_down(handle, incarnation)
                return

    async def _watch_exit(self, handle: ActorHandle, incarnation: int) -> None:
        await handle.process.wait()
        if handle.incarnation == incarnation and handle.state is ActorState.READY:
            await self._mark_down(handle, incarnation)  # which logs the exit status

    async def _mark_down(self, handle: ActorHandle, incarnation: int) -> None:
        if handle.incarnation != incarnation or handle.state in (ActorState.DEAD, ActorState.FAILED):
            return
        was_ready = handle.state is ActorState.READY
        handle.state = ActorState.DEAD
        if was_ready:
            handle.down_at = time.monotonic()
        for task in handle.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if handle.conn is not None:
            handle.conn.close(abort=True)
        if handle.ray is not None:  # whatever noticed it first: the Ray actor must not linger (nor reconnect)
            self.cluster.kill(handle.ray)
        # A drained actor closes its connection on the way out: give it time to exit by itself.
        notice = self.settings.drain_exit_timeout if handle.draining else EXIT_NOTICE_SECONDS
        exited = handle.process is None or await _exits_within(handle.process, notice)
        if not exited:
            handle.process.kill()
            await handle.process.wait()
        if handle.process is not None:
            handle.last_exit = handle.process.returncode
        if was_ready:  # however it was noticed (exit, closed connection, silence), say so once
            code = None if handle.process is None else handle.process.returncode
            how = describe_exit(code) if exited else "stopped by the supervisor (killed by SIGKILL)"
            if handle.ray is not None:
                how = "lost; its Ray actor is killed and a new one takes its place"
            level = logging.INFO if handle.draining and code == 0 else logging.ERROR  # a drain's end is planned
            log.log(level, "actor %s (pid %s) is down: %s", handle.actor_id, handle.pid, how,
                    extra={"actor_id": handle.actor_id, "actor_pid": handle.pid, "exit_status": code})
            await _maybe_await(self._on_down(handle))
        if not self._stopping and (handle.spec.ray or not handle.spec.remote):  # a remote worker reconnects itself
            asyncio.create_task(self._restart(handle))

    async def _restart(self, handle: ActorHandle) -> None:
        if handle.ready is not None and handle.ready.calibration and handle.spec.calibration is None:
            handle.spec = replace(handle.spec, calibration=handle.ready.calibration)  # same spec: same costs
        if handle.draining:  # a planned stop: replace it now, and it counts towards no crash loop
            handle.draining = False
            handle.restarts += 1
            await self._start(handle)
            return
        now = time.monotonic()
        handle.restart_times = [t for t in handle.restart_times if now - t < self.settings.crash_loop_window]
        if len(handle.restart_times) >= self.settings.crash_loop_restarts:
            handle.state = ActorState.FAILED
            log.error("actor %s is crash-looping (%d restarts in %.0fs): not restarting", handle.actor_id,
                      len(handle.restart_times), self.settings.crash_loop_window)
            return
        delay = self.settings.restart_backoff[min(len(handle.restart_times), len(self.settings.restart_backoff) - 1)]
        handle.restart_times.append(now)
        log.warning("restarting actor %s in %g s, restart %d", handle.actor_id, delay, handle.restarts + 1,
                    extra={"actor_id": handle.actor_id})
        await asyncio.sleep(delay)
        if not self._stopping:
            handle.restarts += 1
            await self._start(handle)


EXIT_NOTICE_SECONDS = 0.5  # how long a lost actor gets to be reaped before it is killed (for its exit status)
# How long an actor whose start failed gets to write its reason and exit (its connection closes first, then the
# interpreter with torch loaded winds down: over half a second on a loaded machine). Only a failed start waits;
# an actor that never exits is killed after it.
START_EXIT_SECONDS = 10.0
SOCKET_DIR_KIND = "actors"  # the owned-name kind of the supervisors' socket directories (transport.owned)


async def _ray_stops_within(launched: Any, seconds: float) -> None:
    """Give a Ray actor told to shut down `seconds` to end its run() by itself."""
    try:
        await asyncio.wait_for(launched.finished(), seconds)
    except Exception:  # noqa: BLE001 - late, or already dead: it is killed next either way
        pass


async def _exits_within(process: asyncio.subprocess.Process, seconds: float) -> bool:
    """Whether the process ends by itself within `seconds` (a closed connection is often noticed first)."""
    if process.returncode is None:
        try:
            await asyncio.wait_for(process.wait(), seconds)
        except asyncio.TimeoutError:
            return False
    return True


def describe_exit(returncode: int | None) -> str:
    """'exited with status 1', 'killed by SIGKILL' (asyncio reports death by signal N as -N)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _check_version(hello: m.Hello) -> None:
    if hello.protocol_version != m.PROTOCOL_VERSION:
        raise TransportError(f"protocol version {hello.protocol_version} != {m.PROTOCOL_VERSION}")


def _read_start_error(spec: ActorSpec) -> str | None:
    """What an actor that failed to start wrote about it (actors.worker), if anything."""
    if not spec.error_path:
        return None
    try:
        return Path(spec.error_path).read_text(errors="replace").strip() or None
    except OSError:
        return None


def _project_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


async def _maybe_await(result) -> None:
    if asyncio.iscoroutine(result):
        await result
