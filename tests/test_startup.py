"""The actor start-up timeline: stages add up to the total, and the process age comes from /proc; what the build
reports, and what a connection waiting for Ready hears of it."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from actors.startup import Startup, process_age


def test_marks_split_the_time_since_creation_into_stages():
    startup = Startup(created=100.0)
    startup.mark("interpreter", 100.5)
    startup.mark("imports", 102.0)
    startup.mark("engine", 103.25)
    startup.mark("imports", 103.5)  # a stage may come back: its seconds add up
    assert startup.stages == {"interpreter": 0.5, "imports": 1.75, "engine": 1.25}
    assert startup.total == sum(startup.stages.values()) == 3.5
    assert startup.summary() == "interpreter 0.50, imports 1.75, engine 1.25"


def test_a_stage_block_takes_its_own_time_and_leaves_the_gap_to_other(monkeypatch):
    clock = iter([10.0, 11.0])  # entering the block, leaving it
    monkeypatch.setattr("actors.startup.time.time", lambda: next(clock))
    startup = Startup(created=9.0)
    with startup.stage("calibration"):
        pass
    assert startup.stages == {"other": 1.0, "calibration": 1.0}


@pytest.mark.process
def test_process_age_is_that_of_this_process():
    own = process_age()
    child = float(subprocess.run([sys.executable, "-c", "from actors.startup import process_age; "
                                  "print(process_age())"], capture_output=True, text=True, check=True).stdout)
    assert 0.0 <= child < own  # the child was created after this test process


# the order of the stages: without the weight cache the backend is chosen for the loaded model; with it (on the
# CPU) for the model's skeleton first, since the cache key names the backend
STAGES = {"off": ["reading the checkpoint", "loading weights", "allocating the KV pool", "building kernels",
                  "preparing weights"],
          "on": ["reading the checkpoint", "building kernels", "loading weights", "preparing weights",
                 "allocating the KV pool"]}


@pytest.mark.engine
@pytest.mark.parametrize("weight_cache", ["off", "on"])
def test_the_builder_reports_each_stage_and_every_tensor_it_loads(tiny_model_dir, tmp_path, weight_cache):
    from engine.config import EngineConfig
    from engine.core.builder import build_engine_core
    from engine.model.loader import resolve_model

    heard: list[tuple[str, int, int]] = []
    tensors = len(resolve_model(tiny_model_dir).shapes())
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, dtype="float32", weight_cache=weight_cache,
                          cache_dir=str(tmp_path))
    build_engine_core(config, progress=lambda stage, done, total: heard.append((stage, done, total)))
    loads = [(done, total) for stage, done, total in heard if stage == "loading weights"]
    assert loads == [(n, tensors) for n in range(tensors + 1)]  # 0 of N first, then one report per tensor
    stages = list(dict.fromkeys(stage for stage, _, _ in heard))
    assert stages == STAGES[weight_cache]
    if weight_cache == "on":  # a second start maps the converted weights: one unit, no tensor converted
        heard.clear()
        build_engine_core(config, progress=lambda stage, done, total: heard.append((stage, done, total)))
        assert [(d, t) for stage, d, t in heard if stage == "loading weights"] == [(0, 1), (1, 1)]


class _Conn:
    """Records what an actor sends on a connection."""

    def __init__(self) -> None:
        self.sent: list = []

    async def send(self, msg) -> None:
        self.sent.append(msg)


async def test_a_connection_hears_the_progress_until_the_engine_serves():
    from actors.startup import StartupRelay

    relay = StartupRelay("decode-0")
    step, proceed = threading.Event(), threading.Event()

    def build() -> str:
        for done in range(1, 4):
            relay.report("loading weights", done, 3)  # from the build thread
            step.set()
            proceed.wait()
            proceed.clear()
        return "engine"

    conn = _Conn()
    greeting = asyncio.ensure_future(relay.until_ready(conn))
    building = asyncio.ensure_future(relay.build(build, asyncio.Event(), "build"))
    for done in range(1, 4):
        await asyncio.to_thread(step.wait)
        step.clear()
        while not conn.sent or conn.sent[-1].done != done:  # counted: each report reaches the connection
            await asyncio.sleep(0)
        proceed.set()
    assert await building == "engine" and not greeting.done()  # no Ready before the actor says it serves
    relay.finish(True)
    assert await greeting is True
    assert [m.stage for m in conn.sent] == ["starting"] + ["loading weights"] * 3
    assert [(m.done, m.total, m.unit) for m in conn.sent[1:]] == [(1, 3, "tensors"), (2, 3, "tensors"),
                                                                  (3, 3, "tensors")]
    assert await relay.until_ready(_Conn()) is True  # a later connection: straight to Ready


async def test_a_failed_build_lets_the_waiting_connections_go_and_raises():
    from actors.startup import StartupRelay

    relay = StartupRelay("decode-0")

    def build() -> None:
        raise OSError("no such file")

    greeting = asyncio.ensure_future(relay.until_ready(_Conn()))
    with pytest.raises(OSError, match="no such file"):
        await relay.build(build, asyncio.Event(), "build")
    assert await greeting is False


async def test_an_actor_stopped_while_it_loads_stops_waiting_for_its_build():
    from actors.startup import StartupRelay

    relay, stopped, release = StartupRelay("decode-0"), asyncio.Event(), threading.Event()
    building = asyncio.ensure_future(relay.build(lambda: release.wait(), stopped, "build"))
    await asyncio.sleep(0)
    stopped.set()
    assert await building is None and relay.ready is False
    release.set()
