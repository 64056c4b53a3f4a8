"""An actor process's start-up, stage by stage: the one line that says where a (re)start's seconds went
(`Startup`), and what its connections hear while it loads (`StartupRelay`)."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import psutil

from engine.core.engine_thread import build_in_thread
from engine.model.progress import STAGE_UNITS
from transport import Connection
from transport import messages as m

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STARTING = "starting"  # the stage an actor reports before its build reports one
T = TypeVar("T")


@dataclass
class Startup:
    """Seconds per stage since the process was created: interpreter, imports, engine, calibration, listen."""

    created: float = field(default_factory=time.time)  # Unix time the process began
    stages: dict[str, float] = field(default_factory=dict)
    last: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.last = self.last or self.created

    @staticmethod
    def of_this_process(entered: float) -> "Startup":
        """`entered`: when the worker module began to run (after the interpreter started, before imports)."""
        startup = Startup(time.time() - process_age())
        startup.mark("interpreter", entered)
        startup.mark("imports")
        return startup

    def mark(self, stage: str, now: float | None = None) -> None:
        """The time since the previous mark belongs to `stage`."""
        now = time.time() if now is None else now
        self.stages[stage] = self.stages.get(stage, 0.0) + max(0.0, now - self.last)
        self.last = now

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.mark("other")
        yield
        self.mark(name)

    @property
    def total(self) -> float:
        return self.last - self.created

    def rounded(self) -> dict[str, float]:
        return {name: round(seconds, 3) for name, seconds in self.stages.items()}

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.stages.items())


def process_age() -> float:
    """Seconds since this process was created: /proc's start time in clock ticks against the uptime (10 ms
    resolution; psutil's create_time adds the boot time rounded to whole seconds)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return max(0.0, time.time() - psutil.Process().create_time())


class StartupRelay:
    """An actor's start as its connections see it: the engine built on a thread of its own while the loop serves,
    and the progress the build reports (`report`, from any thread), sent to every connection that waits for
    Ready each time it moves (`until_ready`). Its supervisor gives up on an actor that falls silent, not on one
    that takes long."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id
        self.latest = m.StartupProgress(actor_id, STARTING)
        self.version = 1  # bumps with each report
        self.ready: bool | None = None  # True once the engine serves; False when it never will
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future] = []
        self._wake_pending = False

    def report(self, stage: str, done: int = 0, total: int = 0) -> None:
        """From any thread: the start reached `stage`, `done` of `total` units (engine/model/progress.py)."""
        with self._lock:
            self.latest = m.StartupProgress(self.actor_id, stage, done, total, STAGE_UNITS.get(stage, ""))
            self.version += 1
            if self._wake_pending or self._loop is None:
                return  # a wake-up is on its way, and will find this report
            self._wake_pending = True
        self._loop.call_soon_threadsafe(self._wake)

    async def build(self, build: Callable[[], T], stopped: asyncio.Event, name: str) -> T | None:
        """build() on a thread of its own (engine_thread.build_in_thread); None when `stopped` is set first. Its
        error is raised here, and the connections waiting for Ready are let go. Call `finish` once it serves."""
        self._loop = asyncio.get_running_loop()
        building = asyncio.ensure_future(build_in_thread(build, name))
        stopping = asyncio.ensure_future(stopped.wait())
        await asyncio.wait((building, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not building.done():
            building.cancel()
            self.finish(False)
            return None
        if building.exception() is not None:
            self.finish(False)
        return building.result()

    def finish(self, ready: bool) -> None:
        """On the loop: the start is over; `ready`: the engine serves (Ready may go out)."""
        self.ready = ready
        self._wake()

    async def until_ready(self, conn: Connection) -> bool:
        """Send `conn` the progress each time it moves until the start is over: True when the engine serves (Ready
        goes next), False when it never will. An engine built already sends nothing."""
        seen = 0
        while self.ready is None:
            if self.version != seen:
                seen = self.version
                await conn.send(self.latest)
                continue
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        return self.ready

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
