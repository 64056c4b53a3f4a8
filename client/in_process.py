"""The engine in this process behind the EngineClient interface, stepping on a worker thread."""
from __future__ import annotations

import asyncio
import time

from engine.core.engine_core import EngineCore, EngineRequest
from engine.core.engine_thread import EngineThread
from engine.core.stats import EngineStats


class InProcessClient:
    """The engine in this process, stepping on a worker thread (the default for scripts and tests)."""

    def __init__(self, engine: EngineCore, loop: asyncio.AbstractEventLoop, on_updates, on_error) -> None:
        self.engine = engine
        self.loop = loop
        self._on_error = on_error
        self.thread = EngineThread(engine, loop, on_updates, self._on_step_error)

    async def add(self, request: EngineRequest) -> None:
        """Queue the request; the engine in this process has no placement to report. A constraint is compiled
        on a worker thread first, so the step thread never waits for a new schema."""
        if request.params.guide is not None:
            await asyncio.to_thread(self.engine.prepare_request, request)
        await self.thread.submit(lambda engine: engine.add_request(request))

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        self.thread.post_outputs(lambda engine: engine.abort_request(request_id, sample_index))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def can_serve(self) -> bool:
        return True

    def actors(self) -> list[dict]:
        return []

    def calibration(self) -> dict:
        return {}

    def counters(self) -> dict[str, int]:
        return {}

    def layout_status(self) -> dict:
        return {}

    def begin_shutdown(self) -> None:
        pass  # nothing restarts in process

    async def drain(self, actor_id: str) -> int:
        raise KeyError(actor_id)  # the engine runs in this process: there is no actor to drain

    def placement_of(self, request_id: str) -> None:
        return None

    def trace(self) -> tuple[float, ...]:
        """In process nothing is sent: the step's end stands for both of the first two stamps."""
        done = self.thread.step_done_at
        return done, done, time.monotonic()

    def _on_step_error(self, exc: BaseException) -> None:
        """A step failed: every request in flight ends with the error (the engine aborts them all)."""
        request_ids = list(self.engine.scheduler.by_request)
        self.thread.post_outputs(lambda engine: engine.abort_all())
        for rid in request_ids:
            self._on_error(rid, RuntimeError(f"engine step failed: {exc}"))

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """`close` for a caller without a running loop (the sync `AsyncLLM.shutdown`)."""
        self.thread.shutdown()
        self.engine.abort_all()


