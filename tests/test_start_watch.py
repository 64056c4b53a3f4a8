"""A start fails on silence, never on its total time: an actor that keeps reporting progress past the silence window
is waited for, a silent one is given up with an error naming it and its last stage (fake clock, scripted
messages); progress is logged at a readable rate; and the real supervisor stops a real silent process."""
from __future__ import annotations

import asyncio
import logging
import signal

import pytest

from actors.spec import ActorSpec
from actors.start_watch import LOG_EVERY_SECONDS, StartSilence, StartWatch, await_ready, until_joined
from actors.supervisor import ActorState, Supervisor, SupervisorSettings
from tests.silent_actor import REASON
from transport import TransportError
from transport import messages as m

WINDOW = 60.0
READY = m.Ready("decode-0", 8, 16, {"kind": "none"})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _loading(done: int, total: int = 10) -> m.StartupProgress:
    return m.StartupProgress("decode-0", "loading weights", done, total, "tensors")


def _scripted(clock: Clock, script: list[tuple[float, m.Message]]):
    """recv(timeout) over (seconds after the previous message, message): a message due later than the timeout
    is not there yet (TimeoutError, and the clock moves on by the timeout); past the script, silence."""
    items = list(script)
    received = []

    async def recv(timeout: float) -> m.Message:
        if not items or items[0][0] > timeout:
            if items:
                items[0] = (items[0][0] - timeout, items[0][1])
            clock.now += timeout
            raise TimeoutError
        delay, msg = items.pop(0)
        clock.now += delay
        received.append(msg)
        return msg

    return recv, received


async def test_an_actor_that_keeps_reporting_is_waited_for_far_past_the_window():
    clock = Clock()
    watch = StartWatch("decode-0", WINDOW, clock)
    script = [(50.0, _loading(i)) for i in range(1, 11)] + [(50.0, READY)]  # 550 s in all, 50 s between words
    recv, received = _scripted(clock, script)
    assert await await_ready(recv, watch) is READY
    assert len(received) == 11 and clock.now - watch.started == 550.0 > WINDOW
    assert watch.progress == _loading(10)


async def test_a_silent_actor_is_given_up_naming_it_and_its_last_stage():
    clock = Clock()
    watch = StartWatch("decode-0", WINDOW, clock)
    recv, received = _scripted(clock, [(10.0, _loading(2)), (20.0, _loading(3))])  # then nothing
    with pytest.raises(StartSilence) as info:
        await await_ready(recv, watch)
    assert len(received) == 2 and clock.now == watch.started + 30.0 + WINDOW
    assert str(info.value) == ("decode-0 sent nothing for 60s while starting; it was last at: loading weights "
                               "3/10 tensors")


async def test_a_word_that_comes_after_the_window_comes_too_late():
    clock = Clock()
    recv, received = _scripted(clock, [(10.0, _loading(1)), (WINDOW + 1.0, READY)])
    with pytest.raises(StartSilence, match="loading weights 1/10 tensors"):
        await await_ready(recv, StartWatch("decode-0", WINDOW, clock))
    assert received == [_loading(1)]


async def test_a_start_that_never_reported_says_so():
    clock = Clock()
    recv, _ = _scripted(clock, [])
    with pytest.raises(StartSilence, match=r"decode-0 sent nothing for 60s .* before it listened"):
        await await_ready(recv, StartWatch("decode-0", WINDOW, clock))


async def test_anything_but_progress_or_ready_is_a_protocol_error():
    clock = Clock()
    recv, _ = _scripted(clock, [(1.0, _loading(1)), (1.0, m.Heartbeat(1, 0.0))])
    with pytest.raises(TransportError, match="got Heartbeat"):
        await await_ready(recv, StartWatch("decode-0", WINDOW, clock))


def test_progress_is_logged_per_stage_and_at_most_every_few_seconds_within_one(caplog):
    caplog.set_level(logging.INFO, logger="supervisor")
    clock = Clock()
    watch = StartWatch("decode-0", WINDOW, clock)
    quick = [watch.heard(_loading(i)) for i in range(3)]  # a start that is over in moments logs nothing
    clock.now += LOG_EVERY_SECONDS
    logged = []
    for i in range(3, 10):  # a report every second
        logged.append(watch.heard(_loading(i)))
        clock.now += 1.0
    logged.append(watch.heard(m.StartupProgress("decode-0", "calibrating", 0, 6, "runs")))  # a new stage: at once
    assert quick == [False] * 3
    assert logged == [True, False, False, False, False, True, False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["decode-0 loading weights 3/10 tensors", "decode-0 loading weights 8/10 tensors",
                     "decode-0 calibrating 0/6 runs"]


async def test_a_ray_actor_that_reports_is_waited_for_until_it_joins():
    clock = Clock()
    watch = StartWatch("decode-0", WINDOW, clock)
    joined = asyncio.get_running_loop().create_future()

    async def join_later() -> None:
        for i in range(5):
            clock.now += 50.0  # 250 s in all: past the window, never silent for as long
            watch.heard(_loading(i))
            await asyncio.sleep(0)
        joined.set_result(None)

    task = asyncio.create_task(join_later())
    await until_joined(joined, watch)
    await task
    silent = StartWatch("decode-0", WINDOW, clock)
    clock.now += WINDOW
    with pytest.raises(StartSilence):
        await until_joined(asyncio.get_running_loop().create_future(), silent)


@pytest.mark.process
async def test_the_supervisor_stops_a_silent_actor_process_and_names_its_stage(monkeypatch):
    """tests/silent_actor.py stands in for the worker: it greets, reports one stage, then says nothing."""
    spawn = asyncio.create_subprocess_exec

    async def silent_actor(program, *args, **kwargs):
        return await spawn(program, *["tests.silent_actor" if a == "actors.worker" else a for a in args], **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", silent_actor)
    downs: list[str] = []
    settings = SupervisorSettings(start_silence=5.0, crash_loop_restarts=0)  # one start, not retried
    supervisor = Supervisor([ActorSpec("decode-0", "decode")], lambda handle, msg: None, lambda handle: None,
                            lambda handle: downs.append(handle.actor_id), settings)
    try:
        await supervisor.start()
        handle = supervisor.by_id("decode-0")
        assert handle.state is not ActorState.READY and handle.restarts == 0
        assert downs == []  # it never served, so it never went down
        assert handle.start_error == ("decode-0 sent nothing for 5s while starting; it was last at: loading weights "
                                      "3/10 tensors")
        assert handle.process.returncode == -signal.SIGKILL
    finally:
        await supervisor.stop()


@pytest.mark.process
async def test_a_failed_start_reports_the_actors_reason_written_after_its_connection_closed(monkeypatch):
    """tests/silent_actor.py --fail-slowly closes its connection, then writes its reason and exits seconds later
    (a loaded machine's interpreter wind-down): the supervisor waits for that exit and reports the reason."""
    spawn = asyncio.create_subprocess_exec

    async def failing_actor(program, *args, **kwargs):
        args = [*["tests.silent_actor" if a == "actors.worker" else a for a in args], "--fail-slowly"]
        return await spawn(program, *args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", failing_actor)
    settings = SupervisorSettings(start_silence=60.0, crash_loop_restarts=0)
    supervisor = Supervisor([ActorSpec("decode-0", "decode")], lambda handle, msg: None, lambda handle: None,
                            lambda handle: None, settings)
    try:
        await supervisor.start()
        handle = supervisor.by_id("decode-0")
        assert handle.state is not ActorState.READY
        assert handle.start_error is not None and handle.start_error.endswith(f": {REASON}"), handle.start_error
        assert "exited with status 1" in handle.start_error
    finally:
        await supervisor.stop()
