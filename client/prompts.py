"""The engine configuration the embedded clients build from their arguments."""
from __future__ import annotations

from engine.config import EngineConfig


def engine_config(model: str | None, dtype: str | None, options: dict) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype or "auto", **options)
