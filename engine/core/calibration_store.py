"""Start-up calibration remembered on disk (engine.disk_cache), per model, machine and configuration: an actor
that finds the curves it would measure runs a short warm-up instead of measuring them again.

The key names everything that changes the measured curves: the checkpoint's identity (engine.model.identity)
and the draft model's, the backend as it describes itself (which kernels run, and the build key of the
compiled CPU kernels), torch's version and thread count, the machine's processor and accelerator, the serving
dtype, the engine's options (weight and KV formats, block size, pool size, sequence and token limits, ...) and
the points the procedure will measure. `--recalibrate` measures afresh and replaces the entry."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from engine.config import EngineConfig
from engine.core.calibration import PROCEDURE, Calibration, decode_engine_plan, log_calibration, prefill_engine_plan
from engine.core.engine_core import EngineCore
from engine.core.prefill_engine import PrefillEngine
from engine.disk_cache import DiskCache, cache_root
from engine.kernels.extension_build import cpu_model
from engine.model.errors import ModelLoadError
from engine.model.identity import checkpoint_key

KIND = "calibration"
# Options that do not change what calibration measures (or that the key holds in another form: the models)
UNMEASURED = frozenset({"model", "draft_model", "cache_dir", "recalibrate", "seed", "shm_free_bytes",
                        "kv_stream_overlap", "weight_cache"})

E = TypeVar("E", EngineCore, PrefillEngine)


def start_calibration(engine: E, predecessor: dict | None, measure: Callable[[E], Calibration],
                      warm: Callable[[E], None], log: logging.Logger) -> Calibration:
    """An actor's calibration at start: its predecessor's (a restarted actor's spec carries it, Calibration.to_wire)
    after a warm-up, else the remembered or measured one."""
    if predecessor is None:
        return remembered_calibration(engine, measure, warm, log)
    warm(engine)
    return Calibration.from_wire(predecessor)


def remembered_calibration(engine: E, measure: Callable[[E], Calibration], warm: Callable[[E], None],
                           log: logging.Logger) -> Calibration:
    """The cached calibration of this engine (after `warm(engine)`), else `measure(engine)`, stored. Always
    one log line saying which happened; a cache that cannot be read or written only costs the measurement."""
    cache = DiskCache(cache_root(engine.config.cache_dir))
    key = _key_or_none(engine, log)
    if key is not None and not engine.config.recalibrate:
        found = _lookup(cache, key, log)
        if found is not None:
            warm(engine)
            log_calibration(found, log, f"calibration: reused from {cache.path(KIND, key)}")
            return found
    start = time.perf_counter()
    calibration = measure(engine)
    seconds = time.perf_counter() - start
    forced = " (--recalibrate)" if engine.config.recalibrate else ""
    stored = _store(cache, key, calibration, log)
    log_calibration(calibration, log, f"calibrated in {seconds:.2f} s{forced}, {stored}")
    return calibration


def calibration_key(engine: EngineCore | PrefillEngine) -> dict[str, Any]:
    """What the engine's measured curves depend on, as a JSON-ready dict; ModelLoadError or OSError when a
    model file cannot be read."""
    if isinstance(engine, EngineCore):
        role, (lengths, batches) = "decode", decode_engine_plan(engine)
    else:
        role, lengths, batches = "prefill", prefill_engine_plan(engine), []
    config = engine.config
    return {"procedure": PROCEDURE, "role": role, "plan": {"prefill": lengths, "decode": batches},
            "checkpoint": checkpoint_key(engine.source.path), "draft": _draft_identity(config),
            "options": measured_options(config), "dtype": str(engine.dtype),
            "backend": engine.runner.backend.describe(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": machine(str(engine.runner.device))}


def measured_options(config: EngineConfig) -> dict[str, Any]:
    """The engine options that can change a calibration's curves."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in UNMEASURED}


def _draft_identity(config: EngineConfig) -> dict[str, Any] | str | None:
    """A draft model's checkpoint identity; self:N and other names as written."""
    draft = config.draft_model
    if draft and not draft.startswith("self:") and Path(draft).expanduser().exists():
        return checkpoint_key(draft)
    return draft


def machine(device: str) -> dict[str, Any]:
    """The processor (and accelerator) the curves were measured on."""
    kind = torch.device(device).type
    accelerator = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "device": kind, "accelerator": accelerator}


def _key_or_none(engine: EngineCore | PrefillEngine, log: logging.Logger) -> dict[str, Any] | None:
    try:
        return calibration_key(engine)
    except (ModelLoadError, OSError) as exc:
        log.warning("calibration: no cache key (%s); measuring without the cache", exc)
        return None


def _lookup(cache: DiskCache, key: dict[str, Any], log: logging.Logger) -> Calibration | None:
    raw = cache.get_json(KIND, key)
    if raw is None:
        return None
    try:
        return Calibration.from_wire(raw)
    except (AttributeError, TypeError, ValueError) as exc:
        log.warning("calibration: cache entry %s holds no calibration (%s); measuring again",
                    cache.path(KIND, key), exc)
        return None


def _store(cache: DiskCache, key: dict[str, Any] | None, calibration: Calibration, log: logging.Logger) -> str:
    """Stores the calibration; says where, or that it could not."""
    if key is None:
        return "not stored"
    try:
        return f"stored in {cache.put_json(KIND, key, calibration.to_wire())}"
    except OSError as exc:
        log.warning("calibration: could not store it under %s (%s); the next start measures again", cache.root,
                    exc)
        return "not stored"
