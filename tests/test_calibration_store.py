"""Calibration remembered on disk: a second start with the same model, machine and options reuses the first
one's curves (and warms up instead of measuring); a changed checkpoint, build key or option measures again, as
does --recalibrate; a damaged entry is measured again and rewritten. The measuring functions are counted, never
timed. The actors' own start-up path (DecodeActor / PrefillActor.build_engine) runs here in this process."""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field

import pytest
import torch

from actors import decode_actor, prefill_actor
from actors.decode_actor import DecodeActor
from actors.prefill_actor import PrefillActor
from actors.spec import ActorSpec, Role
from engine.config import EngineConfig
from engine.core import calibration_store
from engine.core.builder import build_engine_core, build_prefill_engine
from engine.core.calibration import Calibration
from engine.core.calibration_store import KIND, calibration_key, remembered_calibration
from engine.disk_cache import DiskCache

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=8)


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    """A copy of the tiny model that a test may touch."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@dataclass
class Counted:
    """Stands in for calibrate_engine and warm_up: counts calls and returns a new calibration each time."""

    measured: int = 0
    warmed: int = 0
    returned: list[Calibration] = field(default_factory=list)

    def measure(self, engine) -> Calibration:
        self.measured += 1
        self.returned.append(Calibration([(32, 0.01 * self.measured)], [(1, 0.001 * self.measured)]))
        return self.returned[-1]

    def warm(self, engine) -> None:
        self.warmed += 1


def _start(model, cache_dir, counted: Counted, log=logging.getLogger("test.calibration"), **options):
    """One engine start: build the engine, then find or measure its calibration."""
    engine = build_engine_core(EngineConfig(model=str(model), cache_dir=str(cache_dir), **{**OPTIONS, **options}))
    return remembered_calibration(engine, counted.measure, counted.warm, log), engine


def test_a_second_start_reuses_the_first_ones_calibration(model, cache_dir, caplog):
    counted = Counted()
    with caplog.at_level(logging.INFO, logger="test.calibration"):
        first, engine = _start(model, cache_dir, counted)
        second, _ = _start(model, cache_dir, counted)
    assert (counted.measured, counted.warmed) == (1, 1) and second == first == counted.returned[0]
    entry = DiskCache(cache_dir).path(KIND, calibration_key(engine))
    measured_line, reused_line = [r.getMessage() for r in caplog.records]
    assert measured_line.startswith("calibrated in ") and f"stored in {entry}" in measured_line
    assert reused_line.startswith(f"calibration: reused from {entry}:")


def test_a_changed_checkpoint_is_measured_again(model, cache_dir):
    counted = Counted()
    _start(model, cache_dir, counted)
    weights = next(model.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _start(model, cache_dir, counted)
    _start(model, cache_dir, counted)
    assert (counted.measured, counted.warmed) == (2, 1)


def test_a_changed_kernel_build_is_measured_again(model, cache_dir, monkeypatch):
    counted = Counted()
    _, engine = _start(model, cache_dir, counted)
    described = engine.runner.backend.describe()
    backend_class = type(engine.runner.backend)
    monkeypatch.setattr(backend_class, "describe", lambda self: {**described, "build_key": "phase_serve_cpu_ext_x"})
    _start(model, cache_dir, counted)
    assert (counted.measured, counted.warmed) == (2, 0)


@pytest.mark.parametrize("options", [dict(block_size=16), dict(max_num_seqs=4), dict(kv_cache_dtype="fp8"),
                                     dict(num_kv_blocks=128), dict(weight_dtype="int8")])
def test_an_option_that_changes_the_curves_is_measured_again(model, cache_dir, options):
    counted = Counted()
    _start(model, cache_dir, counted)
    _start(model, cache_dir, counted, **options)
    assert (counted.measured, counted.warmed) == (2, 0)


def test_a_changed_thread_count_is_measured_again(model, cache_dir):
    counted = Counted()
    try:
        _start(model, cache_dir, counted, num_threads=1)
        _start(model, cache_dir, counted, num_threads=2)
    finally:
        torch.set_num_threads(1)  # what the module's one_thread fixture set
    assert (counted.measured, counted.warmed) == (2, 0)


def test_recalibrate_measures_and_replaces_the_entry(model, cache_dir, caplog):
    counted = Counted()
    _start(model, cache_dir, counted)
    with caplog.at_level(logging.INFO, logger="test.calibration"):
        forced, _ = _start(model, cache_dir, counted, recalibrate=True)
    assert counted.measured == 2 and forced == counted.returned[1] != counted.returned[0]
    assert "(--recalibrate)" in caplog.records[-1].getMessage()
    again, _ = _start(model, cache_dir, counted)
    assert again == counted.returned[1] and (counted.measured, counted.warmed) == (2, 1)


def _half(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage", [_half, lambda p: p.write_bytes(b"\x00garbage\n{}"),
                                    lambda p: p.write_bytes(b"")])
def test_a_damaged_entry_is_measured_again_and_rewritten(model, cache_dir, damage, caplog):
    counted = Counted()
    _, engine = _start(model, cache_dir, counted)
    damage(DiskCache(cache_dir).path(KIND, calibration_key(engine)))
    with caplog.at_level(logging.WARNING):
        _start(model, cache_dir, counted)
    assert counted.measured == 2 and any("treated as a miss" in r.getMessage() for r in caplog.records)
    third, _ = _start(model, cache_dir, counted)
    assert third == counted.returned[1] and (counted.measured, counted.warmed) == (2, 1)


def test_an_entry_that_holds_no_calibration_is_measured_again(model, cache_dir, caplog):
    counted = Counted()
    _, engine = _start(model, cache_dir, counted)
    DiskCache(cache_dir).put_json(KIND, calibration_key(engine), {"prefill": [["x"]]})
    with caplog.at_level(logging.WARNING, logger="test.calibration"):
        _start(model, cache_dir, counted)
    assert counted.measured == 2 and "holds no calibration" in caplog.text


def test_a_cache_that_cannot_be_written_costs_only_the_measurement(model, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    counted = Counted()
    with caplog.at_level(logging.INFO, logger="test.calibration"):
        first, _ = _start(model, blocker / "cache", counted)
        second, _ = _start(model, blocker / "cache", counted)
    assert first == counted.returned[0] and (counted.measured, counted.warmed) == (2, 0)
    assert "could not store it" in caplog.text and "not stored" in caplog.text


def test_without_the_flag_the_default_root_is_used(model, monkeypatch, tmp_path):
    monkeypatch.setenv("PHASE_SERVE_CACHE_DIR", str(tmp_path / "env-root"))
    counted = Counted()
    engine = build_engine_core(EngineConfig(model=str(model), **OPTIONS))
    remembered_calibration(engine, counted.measure, counted.warm, logging.getLogger("test"))
    assert DiskCache(tmp_path / "env-root").get_json(KIND, calibration_key(engine)) == counted.returned[0].to_wire()


def test_decode_and_prefill_engines_of_one_model_keep_separate_entries(model, cache_dir):
    options = dict(OPTIONS, model=str(model), cache_dir=str(cache_dir))
    decode = build_engine_core(EngineConfig(**options))
    prefill = build_prefill_engine(EngineConfig(**options))
    assert calibration_key(decode)["role"] == "decode" and calibration_key(prefill)["role"] == "prefill"
    assert DiskCache(cache_dir).path(KIND, calibration_key(decode)) != \
        DiskCache(cache_dir).path(KIND, calibration_key(prefill))
    assert calibration_key(decode)["plan"] == {"prefill": [32, 128], "decode": [1, 4]}  # half of 64 blocks of 8


def _spec(role: Role, model, cache_dir, **options) -> ActorSpec:
    return ActorSpec(f"{role.value}-0", role, engine=dict(OPTIONS, model=str(model), cache_dir=str(cache_dir),
                                                          **options))


@pytest.mark.parametrize("role, module, measure, warm", [
    (Role.DECODE, decode_actor, "calibrate_engine", "warm_up"),
    (Role.PREFILL, prefill_actor, "calibrate_prefill_engine", "warm_up_prefill")])
def test_an_actors_second_start_reuses_its_calibration_and_recalibrate_forces(model, cache_dir, monkeypatch,
                                                                              role, module, measure, warm):
    calls = {"measure": 0, "warm": 0}
    real_measure, real_warm = getattr(module, measure), getattr(module, warm)

    def counted(name, real):
        def call(engine, **options):  # options: the actor's progress relay
            calls[name] += 1
            return real(engine, **options)
        return call

    monkeypatch.setattr(module, measure, counted("measure", real_measure))
    monkeypatch.setattr(module, warm, counted("warm", real_warm))
    actor_class = DecodeActor if role is Role.DECODE else PrefillActor
    starts = []
    for options in ({}, {}, {"recalibrate": True}):
        actor = actor_class(_spec(role, model, cache_dir, **options))
        actor.build_engine()
        starts.append(actor.calibration)
    assert calls == {"measure": 2, "warm": 1}
    assert starts[1] == starts[0] and starts[0].prefill and starts[2].prefill
    if role is Role.PREFILL:
        assert actor.engine.pools == {} and actor.engine.jobs == {}  # the warm-up's scratch pool is gone
    else:
        actor.engine.pool.check_integrity()
        assert actor.engine.pool.num_used == 0


def test_a_restarted_actor_reuses_its_predecessors_calibration_without_the_cache(model, cache_dir, monkeypatch):
    monkeypatch.setattr(calibration_store, "DiskCache", None)  # any use of the cache would fail
    calibration = Calibration([(32, 0.5)], [(1, 0.25)])
    spec = ActorSpec("decode-0", Role.DECODE, engine=dict(OPTIONS, model=str(model), cache_dir=str(cache_dir)),
                     calibration=calibration.to_wire())
    actor = DecodeActor(spec)
    actor.build_engine()
    assert actor.calibration == calibration and not (cache_dir / KIND).exists()
