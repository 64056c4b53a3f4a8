"""The actor start-up timeline: stages add up to the total, and the process age comes from /proc."""
from __future__ import annotations

import subprocess
import sys

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


@pytest.mark.engine
def test_the_builder_reports_each_stage_and_every_tensor_it_loads(tiny_model_dir):
    from engine.config import EngineConfig
    from engine.core.builder import build_engine_core
    from engine.model.loader import resolve_model

    heard: list[tuple[str, int, int]] = []
    tensors = len(resolve_model(tiny_model_dir).shapes())
    build_engine_core(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, dtype="float32"),
                      progress=lambda stage, done, total: heard.append((stage, done, total)))
    loads = [(done, total) for stage, done, total in heard if stage == "loading weights"]
    assert loads == [(n, tensors) for n in range(tensors + 1)]  # 0 of N first, then one report per tensor
    stages = list(dict.fromkeys(stage for stage, _, _ in heard))
    assert stages == ["reading the checkpoint", "loading weights", "allocating the KV pool", "building kernels",
                      "preparing weights"]
