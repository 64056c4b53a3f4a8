"""An actor process's start-up, stage by stage: the one line that says where a (re)start's seconds went."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import psutil

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


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
