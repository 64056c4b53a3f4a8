"""Classifies a request by prompt length and requested output length into one of four quadrants.

The quadrant labels latency metrics today; a later issue uses it to place requests on actors.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.config import ConfigError


class Quadrant(str, enum.Enum):
    SISO = "SISO"  # short in, short out
    LISO = "LISO"  # long in, short out
    SILO = "SILO"  # short in, long out
    LILO = "LILO"  # long in, long out


@dataclass(frozen=True)
class QuadrantThresholds:
    """A prompt of at least `long_prompt_tokens` is long-in; `max_tokens` of at least `long_output_tokens` is
    long-out."""

    long_prompt_tokens: int = 512
    long_output_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("long_prompt_tokens", "long_output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")


_BY_LENGTHS = {(False, False): Quadrant.SISO, (True, False): Quadrant.LISO,
               (False, True): Quadrant.SILO, (True, True): Quadrant.LILO}


def classify(prompt_tokens: int, max_tokens: int,
             thresholds: QuadrantThresholds = QuadrantThresholds()) -> Quadrant:
    long_in = prompt_tokens >= thresholds.long_prompt_tokens
    long_out = max_tokens >= thresholds.long_output_tokens
    return _BY_LENGTHS[(long_in, long_out)]
