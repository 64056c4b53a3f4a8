"""An actor's start as its supervisor watches it: the progress it reports (StartupProgress, between Hello and
Ready), logged at a readable rate, and the rule that ends a start: silence, never a total time.

Loading a model takes as long as its size and the machine make it (a 1B model on a busy host, an 8B one
anywhere, take minutes); a start that still reports is going somewhere. So a start fails when the actor has sent
nothing for `silence` seconds (a process that hangs, or waits on something that never comes), or when its process
exits; there is no cap on the total. The silence window must outlast the longest stretch the actor cannot report
in: its interpreter and imports before it listens, and the longest single unit of a stage (one tensor, a kernel
build, one calibration run).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from transport import TransportError
from transport import messages as m

log = logging.getLogger("supervisor")
DEFAULT_START_SILENCE = 120.0  # seconds; serve --actor-start-silence
# A start quicker than this logs no progress; a longer one logs each stage, and within a stage at most this often
LOG_EVERY_SECONDS = 5.0
BEFORE_FIRST_REPORT = "starting (interpreter and imports, before it listened)"


class StartSilence(TimeoutError):
    """An actor that was starting sent nothing for the silence window; the message names it and its last stage."""


@dataclass
class StartWatch:
    """What one start of one actor has reported, and when it last did (on `clock`, monotonic seconds)."""

    actor_id: str
    silence: float
    clock: Callable[[], float] = time.monotonic
    progress: m.StartupProgress | None = None
    started: float = field(init=False)
    last_heard: float = field(init=False)
    _logged: tuple[str, float] = field(default=("", 0.0), init=False)  # (stage, when) of the last progress line

    def __post_init__(self) -> None:
        self.started = self.last_heard = self.clock()

    def heard(self, progress: m.StartupProgress | None = None) -> bool:
        """The actor said something (Hello, or how far it has come): the silence window starts again. True when
        this progress made a log line."""
        now = self.last_heard = self.clock()
        if progress is None:
            return False
        self.progress = progress
        stage, logged_at = self._logged
        if now - self.started < LOG_EVERY_SECONDS or (stage == progress.stage and now - logged_at < LOG_EVERY_SECONDS):
            return False
        self._logged = (progress.stage, now)
        log.info("%s %s", self.actor_id, progress.describe(),
                 extra={"actor_id": self.actor_id, "stage": progress.stage, "done": progress.done,
                        "total": progress.total})
        return True

    def remaining(self) -> float:
        """Seconds of silence left before the start fails (0 or less: it has failed)."""
        return self.last_heard + self.silence - self.clock()

    def where(self) -> str:
        return self.progress.describe() if self.progress is not None else BEFORE_FIRST_REPORT

    def silent(self) -> StartSilence:
        return StartSilence(f"{self.actor_id} sent nothing for {self.silence:g}s while starting; it was last at: "
                            f"{self.where()}")


Recv = Callable[[float], Awaitable[m.Message]]  # the next message, TimeoutError after that many seconds


async def await_ready(recv: Recv, watch: StartWatch) -> m.Ready:
    """Read an actor's progress after its Hello until its Ready; StartSilence when it falls silent for the
    window, TransportError for anything else it sends."""
    while True:
        timeout = watch.remaining()
        if timeout <= 0:
            raise watch.silent()
        try:
            msg = await recv(timeout)
        except TimeoutError:
            continue  # the window is checked again: progress noted elsewhere (a Ray actor's join) may extend it
        if isinstance(msg, m.Ready):
            return msg
        if not isinstance(msg, m.StartupProgress):
            raise TransportError(f"expected StartupProgress or Ready, got {type(msg).__name__}")
        watch.heard(msg)


async def until_joined(joined: asyncio.Future, watch: StartWatch) -> None:
    """Wait for `joined` (a Ray actor's Hello + Ready) while `watch` hears from the actor; StartSilence when it
    falls silent for the window first."""
    while True:
        timeout = watch.remaining()
        if timeout <= 0:
            raise watch.silent()
        try:
            await asyncio.wait_for(asyncio.shield(joined), timeout)
            return
        except TimeoutError:
            continue
