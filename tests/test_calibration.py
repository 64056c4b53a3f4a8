"""Start-up calibration measures real steps and leaves the engine as it found it."""
from __future__ import annotations

from engine.core.builder import build_engine_core, build_prefill_engine
from engine.core.calibration import calibrate_engine, calibrate_prefill_engine
from engine.config import EngineConfig
from router.cost_model import DecodeCost, PrefillCost


def test_decode_engine_calibration(tiny_model_dir):
    engine = build_engine_core(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256,
                                            block_size=8))
    heard = []
    calib = calibrate_engine(engine, progress=lambda stage, done, total: heard.append((stage, done, total)))
    assert heard == [("calibrating", n, 6) for n in range(7)]  # one report per timing, after it
    assert [n for n, _ in calib.prefill] == [32, 128, 384]
    assert [b for b, _ in calib.decode] == [1, 4, 16]
    assert all(seconds > 0 for _, seconds in calib.prefill + calib.decode)
    assert PrefillCost.fit(calib.prefill).seconds(256) > 0 and DecodeCost.fit(calib.decode).step_seconds(8) > 0
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    assert calib.to_wire()["prefill"][0][0] == 32


def test_prefill_engine_calibration_detaches_its_scratch_pool(tiny_model_dir):
    engine = build_prefill_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=8))
    heard = []
    calib = calibrate_prefill_engine(engine, progress=lambda stage, done, total: heard.append((stage, done, total)))
    assert heard == [("calibrating", n, 3) for n in range(4)]
    assert [n for n, _ in calib.prefill] == [32, 128, 384] and calib.decode == []
    assert engine.pools == {} and engine.jobs == {}
