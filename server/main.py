"""`python cli.py serve`: load the engine, serve the app on uvloop, drain gracefully on SIGINT / SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from dataclasses import dataclass, replace

import structlog
import uvloop
from aiohttp import web

from engine.config import ConfigError, EngineConfig
from engine.flags import options
from client import AsyncLLM
from engine.model.errors import ModelLoadError
from server.app import active_defaults, create_app
from server.args import actor_options, log_settings, quadrant_thresholds, server_settings
from server.context import CONTEXT, ServerContext
from server.logging import configure_logging
from server.settings import ServerSettings

ABORT_WAIT_SECONDS = 5.0  # after the grace period: how long aborted requests get to send their last event
RUNNER_SHUTDOWN_SECONDS = 2.0  # then aiohttp cancels whatever handler is still running


def serve(args: argparse.Namespace) -> int:
    """The `serve` command; returns the process exit status."""
    log = configure_logging(log_settings(args))
    try:
        settings = server_settings(args)
        return uvloop.run(_serve(settings, options(EngineConfig, args) | actor_options(args), args, log))
    except (ModelLoadError, ConfigError) as exc:
        log.error("cannot start", error=str(exc))
        return 2


@dataclass
class _Shutdown:
    """Set by the first SIGINT/SIGTERM (drain), and by a second one (stop waiting, abort now)."""

    requested: asyncio.Event
    forced: asyncio.Event

    def on_signal(self) -> None:
        (self.forced if self.requested.is_set() else self.requested).set()


async def _serve(settings: ServerSettings, options: dict, args: argparse.Namespace,
                 log: structlog.stdlib.BoundLogger) -> int:
    sock = bind(settings.host, settings.port)  # before the model loads: a busy port fails at once
    try:
        return await _serve_on(sock, settings, options, args, log)
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port but not yet listening: the port is ours, and until the engine is up a client
    gets 'connection refused' rather than a connection nobody answers."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.setblocking(False)
    return sock


async def _serve_on(sock: socket.socket, settings: ServerSettings, options: dict, args: argparse.Namespace,
                    log: structlog.stdlib.BoundLogger) -> int:
    llm = AsyncLLM(**options, stream_interval=settings.stream_interval, trace_tokens=settings.trace_tokens)
    settings = replace(settings, quadrants=quadrant_thresholds(args, llm.max_model_len))
    log.info("starting engine", actors=llm.layout.uses_actors, decode_actors=llm.layout.decode_actors,
             prefill_actors=llm.layout.prefill_actors, draft_actors=llm.layout.draft_actors, disagg=llm.layout.disagg)
    try:
        await llm.start()
    except Exception as exc:
        await llm.aclose()
        raise ConfigError(f"the engine did not start: {exc}") from None
    app = create_app(llm, settings, log)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=RUNNER_SHUTDOWN_SECONDS)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
    except OSError as exc:
        await runner.cleanup()
        await llm.aclose()
        raise ConfigError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from None
    _announce(app[CONTEXT], runner, log)
    shutdown = _Shutdown(asyncio.Event(), asyncio.Event())
    _install_signal_handlers(shutdown)
    await shutdown.requested.wait()
    await drain(app[CONTEXT], shutdown.forced, log)
    await runner.cleanup()
    await llm.aclose()
    log.info("stopped")
    return 0


def _announce(ctx: ServerContext, runner: web.AppRunner, log: structlog.stdlib.BoundLogger) -> None:
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    backend = backend_summary(ctx.llm.backend(), ctx.llm.actors())
    # One line in the log's own format; the event keeps the words "serving MODEL on URL (BACKEND)" that scripts
    # (bench/serve_latency.py) look for with `serving .* on (http://\S+)`.
    log.info(f"serving {ctx.limits.name} on {url} ({backend})", url=url, model=ctx.limits.name, dtype=ctx.dtype,
             max_model_len=ctx.limits.max_model_len, backend=backend, defaults=active_defaults(ctx))


def backend_summary(in_process: dict | None, actors: list[dict]) -> str:
    """'cpu-kernels (vectors)' or 'torch': the backends that run, from the engine's or each actor's description."""
    described = [in_process] if in_process else [a["backend"] for a in actors if a.get("backend")]
    names = {d["backend"] + (f" ({d['matrix_engine']})" if d.get("matrix_engine") else "") for d in described}
    return ", ".join(sorted(names)) or "no engine ready"


def _install_signal_handlers(shutdown: _Shutdown) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.on_signal)


async def drain(ctx: ServerContext, forced: asyncio.Event, log: structlog.stdlib.BoundLogger) -> None:
    """Stop admitting (503), give in-flight requests the grace period, then abort the rest."""
    ctx.admission.start_draining()
    ctx.llm.begin_shutdown()
    log.info("draining", in_flight=len(ctx.admission.active_ids), grace_period=ctx.settings.grace_period)
    if await _idle_or_forced(ctx, forced, ctx.settings.grace_period):
        return
    log.warning("aborting requests still in flight", request_ids=ctx.admission.active_ids)
    for request_id in ctx.admission.active_ids:
        ctx.llm.abort(request_id)
    await ctx.admission.wait_idle(ABORT_WAIT_SECONDS)


async def _idle_or_forced(ctx: ServerContext, forced: asyncio.Event, timeout: float) -> bool:
    """True when every request finished in time; False on timeout or a second signal."""
    idle = asyncio.ensure_future(ctx.admission.wait_idle(timeout))
    force = asyncio.ensure_future(forced.wait())
    await asyncio.wait((idle, force), return_when=asyncio.FIRST_COMPLETED)
    finished = idle.done() and idle.result()
    idle.cancel()
    force.cancel()
    return finished
