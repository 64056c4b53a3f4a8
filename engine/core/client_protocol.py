"""EngineClient: what `AsyncLLM` drives, whether the engine runs in this process (client.in_process) or in
actor subprocesses behind the router (router.router.ActorRouter).

The engine layer declares the interface and the errors a client may raise, and the layers above implement
it, so nothing here imports them.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.engine_core import EngineRequest
    from engine.core.stats import EngineStats


class RequestFailedError(RuntimeError):
    """The request could not be completed (after retries, or after its stream could not be moved)."""


class NoCapacityError(RequestFailedError):
    """No decode actor came (back) up in time: worth retrying later (the server's 503 with Retry-After)."""


class RequestPlacement(Protocol):
    """Where a request runs, as the client reports it on each output."""

    path: str
    moves: tuple[str, ...]  # the stream's migrations so far, "decode-0->decode-1"

    def header(self) -> str: ...


class EngineClient(Protocol):
    """Requests in, token updates out through the callbacks the client was built with; one `close`."""

    loop: asyncio.AbstractEventLoop

    async def add(self, request: EngineRequest) -> RequestPlacement | None:
        """Queue a request; its placement when one was decided now (None: in-process, or parked)."""

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        """Stop one sample of a request, or all of them; unknown ids are ignored."""

    def stats(self) -> EngineStats:
        """Queues and KV pool(s), summed over whatever engines serve."""

    def can_serve(self) -> bool:
        """Whether a request added now could run (a decode actor is up)."""

    def actors(self) -> list[dict]:
        """One entry per actor process for /status (empty in-process)."""

    def calibration(self) -> dict:
        """Per-actor fitted costs for /status (empty in-process)."""

    def counters(self) -> dict[str, int]:
        """Cumulative router counters for /metrics (KV hand-offs, stream migrations; empty in-process)."""

    def layout_status(self) -> dict:
        """The actors' layout and the elastic planner's last decision for /status and /metrics (empty in-process)."""

    def begin_shutdown(self) -> None:
        """The server is draining: actors that exit or ask to leave now are neither replaced nor drained."""

    async def drain(self, actor_id: str) -> int:
        """Move an actor's requests elsewhere and restart it; how many moved (KeyError: no such actor)."""

    def placement_of(self, request_id: str) -> RequestPlacement | None:
        """The request's current placement (it changes when a request fails over)."""

    def trace(self) -> tuple[float, ...]:
        """Called from inside on_updates: when the batch being delivered left the engine's step, was sent and was
        received here (time.monotonic()); for token tracing (AsyncLLM(trace_tokens=True))."""
        ...

    async def close(self) -> None:
        """Fail or abort every request in flight and release the engine(s)."""


ENGINE_CLIENT_METHODS = ("add", "abort", "stats", "can_serve", "actors", "calibration", "counters", "layout_status",
                         "begin_shutdown", "drain", "placement_of", "trace", "close")
