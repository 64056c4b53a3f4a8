"""An actor process's start-up, stage by stage: the one line that says where a (re)start's seconds went."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import psutil


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
        startup = Startup(psutil.Process().create_time())
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
