"""Which threads the engine is built and stepped on: the build runs on a thread that exits, so the only OpenMP
team left in the process is the step thread's (see engine.core.engine_thread.build_off_thread)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from actors.actor import Actor
from actors.spec import ActorSpec
from engine.core.engine_thread import build_in_thread, build_off_thread


def test_build_off_thread_runs_on_a_thread_that_has_exited():
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "engine"

    assert build_off_thread(build) == "engine"
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_build_off_thread_raises_the_builds_error_on_the_caller():
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_off_thread(build)


async def test_build_in_thread_leaves_the_loop_free_and_its_thread_gone():
    started, release = threading.Event(), threading.Event()
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        started.set()
        release.wait()
        return "engine"

    building = asyncio.ensure_future(build_in_thread(build))
    await asyncio.to_thread(started.wait)  # the loop runs this while the build waits (a blocked one never would)
    assert not building.done()
    asyncio.get_running_loop().call_soon(release.set)  # from the loop itself: it must be free to run this
    assert await building == "engine"
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


async def test_build_in_thread_raises_the_builds_error_on_the_loop():
    def build() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        await build_in_thread(build)


class _Idle:
    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        return []


class _RecordingActor(Actor):
    def __init__(self) -> None:
        super().__init__(ActorSpec("decode-0", "decode"))
        self.built_on: threading.Thread | None = None
        self.tasks_started_on: threading.Thread | None = None

    def build_engine(self) -> _Idle:
        self.built_on = threading.current_thread()
        return _Idle()

    def start_tasks(self) -> None:
        self.tasks_started_on = threading.current_thread()


def test_an_actor_builds_its_engine_off_the_loop_and_starts_its_tasks_on_it():
    actor = _RecordingActor()

    async def start() -> threading.Thread:
        assert await actor._start_engine()
        actor._stop_engine()
        return threading.current_thread()

    loop_thread = asyncio.run(start())
    assert actor.built_on is not None and actor.built_on is not loop_thread
    assert not actor.built_on.is_alive()
    assert actor.tasks_started_on is loop_thread
