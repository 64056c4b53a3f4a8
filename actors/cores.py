"""An actor's cores and thread count changed while it serves (router -> SetCores): the elastic planner widens a
decode actor onto the cores of the peers it has stopped placing work on, and narrows it back before they serve
again. The change runs on the engine thread between two steps, so no step runs half on the old cores."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.core.engine_thread import EngineThread
from transport import messages as m

log = logging.getLogger("actor")


def process_threads() -> list[int]:
    """The ids of this process's threads (Linux: /proc/self/task)."""
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def use_cores(threads: int, cpus: Sequence[int]) -> None:
    """Call on the engine thread. Every thread of the process is moved onto `cpus` first (a worker thread OpenMP
    starts later inherits the engine thread's set), then the engine thread's parallel regions take `threads`
    threads (OpenMP's thread count belongs to the thread that opens the region: the engine thread runs the steps)."""
    if threads < 1:
        raise ValueError(f"an actor needs at least one thread, got {threads}")
    if cpus:
        for tid in process_threads():
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    torch.set_num_threads(threads)


async def set_cores(actor_id: str, thread: EngineThread | None, changing: bool, msg: m.SetCores) -> m.CoresSet:
    """SetCores on an actor whose steps run on `thread` (None, or `changing` role: refused): the answer to send."""
    started = time.monotonic()
    answer = m.CoresSet(actor_id, msg.threads, list(msg.cpus))
    if changing or thread is None:
        return replace(answer, error="the actor is changing role")
    try:
        await thread.submit(lambda engine: use_cores(msg.threads, msg.cpus))
    except (ValueError, OSError) as exc:
        return replace(answer, error=f"cannot run {msg.threads} threads on cores {msg.cpus}: {exc}")
    seconds = time.monotonic() - started
    log.info("actor %s runs %d threads on cores %s now (%.3fs)", actor_id, msg.threads, msg.cpus or "as before",
             seconds, extra={"threads": msg.threads, "cpus": msg.cpus})
    return replace(answer, seconds=seconds)
