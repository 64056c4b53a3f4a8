"""Run an engine's steps on a worker thread while an asyncio loop owns everything else.

Every call that touches the engine is a closure queued to that thread and run between two steps, so the
engine never sees two threads. Results and step outputs come back on the loop. Both the in-process
`AsyncLLM` and the actor subprocesses use this, which keeps their loops responsive during long steps.

Build the engine with `build_off_thread` (or, from a coroutine, `build_in_thread`), never on the loop's thread:
see its docstring.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_off_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """Runs build() on a thread of its own, which then exits, and returns its result (or raises its error).

    libgomp gives each thread that opens a parallel region a team of worker threads that lives as long as
    that thread. Once a process holds more OpenMP threads than it has cores, every barrier sleeps instead of
    spinning, and a decode step (hundreds of barriers) slows markedly (python -m bench.serve_latency). A
    model loaded and warmed on the loop's thread would leave such a team behind beside the step thread's.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


async def build_in_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """build_off_thread for a caller on an event loop, which stays free meanwhile (an actor answers its
    supervisor with start-up progress while its model loads): build() runs on a thread of its own, which has
    exited by the time this returns its result (or raises its error)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = build()
        except BaseException as exc:  # noqa: BLE001 - raised on the loop
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while this built: nobody waits for it any more
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    result = await done  # cancelled (the actor stops while it loads): the daemon thread is left to finish
    thread.join()  # it is past its last statement: its OpenMP team goes with it, before any step
    return result


class Steppable(Protocol):
    def has_work(self) -> bool: ...

    def step(self) -> list: ...


class EngineThread:
    IDLE_POLL_SECONDS = 0.5

    def __init__(self, engine: Steppable, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[list], None],
                 on_step_error: Callable[[BaseException], None], name: str = "engine-step") -> None:
        self.engine = engine
        self.loop = loop
        self._on_outputs = on_outputs
        self._on_step_error = on_step_error
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.step_done_at = 0.0  # on the loop, while outputs are delivered: when the step that made them ended
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread; its result (or exception) resolves the returned future."""
        future = self.loop.create_future()
        self._calls.put((fn, future, False))
        return future

    def post(self, fn: Callable[[Any], Any]) -> None:
        """Run fn(engine) on the engine thread, without waiting; what it returns is dropped."""
        self._calls.put((fn, None, False))

    def post_outputs(self, fn: Callable[[Any], list]) -> None:
        """Run fn(engine) on the engine thread, without waiting; the outputs it returns are delivered like a
        step's (an abort's finish rows)."""
        self._calls.put((fn, None, True))

    def emit(self, outputs: list) -> None:
        """From the engine thread: deliver outputs now, ahead of the next step's (order is preserved)."""
        if outputs:
            self._to_loop(self._on_outputs, outputs)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._calls.put((None, None, False))
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_calls(block=not self.engine.has_work())
            if self.engine.has_work() and not self._stopped.is_set():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failing step must fail its requests, never leave callers waiting
            log.exception("engine step failed")
            self._to_loop(self._on_step_error, exc)
            return
        if outputs:
            self._to_loop(self._deliver, outputs, time.monotonic())

    def _deliver(self, outputs: list, step_done: float) -> None:
        self.step_done_at = step_done
        self._on_outputs(outputs)

    def _run_calls(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self.IDLE_POLL_SECONDS) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item[0] is not None:
            self._run_call(*item)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _run_call(self, fn: Callable[[Any], Any], future: asyncio.Future | None, emits: bool) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:
            if future is None:
                log.exception("engine call failed")
            else:
                self._to_loop(_settle, future, None, exc)
            return
        if future is not None:
            self._to_loop(_settle, future, result, None)
        elif emits:
            self.emit(result)

    def _to_loop(self, fn: Callable, *args: Any) -> None:
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed between the check and the call
                pass


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)
