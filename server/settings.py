"""The server's own settings (the engine's live in engine.config.EngineConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ConfigError
from server.quadrant import QuadrantThresholds, check_speculate_quadrants

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None
    max_queue: int = 256  # requests in flight (waiting + running) before 429
    served_model_name: str | None = None  # default: the model's own name
    grace_period: float = 30.0  # seconds in-flight requests get to finish on SIGINT/SIGTERM
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    quadrants: QuadrantThresholds = field(default_factory=QuadrantThresholds)
    speculate_quadrants: str = "silo"  # which requests speculate when speculation is configured: silo | all

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be between 0 and 65535, got {self.port}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.grace_period < 0:
            raise ConfigError(f"grace_period must be at least 0 seconds, got {self.grace_period}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty; leave it unset to disable authentication")
        check_speculate_quadrants(self.speculate_quadrants)
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be blank")
