"""Classifies a request by prompt length and requested output length into one of four quadrants, and picks
the treatment each quadrant gets from the engine (speculative decoding, KV compression priority).

The quadrant labels the latency and speculation metrics.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, get_args

from engine.config import ConfigError
from engine.core.treatment import Treatment


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


SpeculateQuadrants = Literal["silo", "all"]  # silo: only SILO requests speculate; all: every request does
SPECULATE_QUADRANTS = get_args(SpeculateQuadrants)


@dataclass(frozen=True)
class TreatmentOptions:
    """What the engine is configured for, and which requests may use it."""

    speculation: bool = False  # a proposer is configured (--speculative ngram|draft)
    kv_compress: bool = False  # adaptive compression of old pages is on (--kv-compress fp4)
    speculate_quadrants: SpeculateQuadrants = "silo"

    def __post_init__(self) -> None:
        check_speculate_quadrants(self.speculate_quadrants)


def check_speculate_quadrants(value: str) -> None:
    if value not in SPECULATE_QUADRANTS:
        raise ConfigError(f"speculate_quadrants must be one of {', '.join(SPECULATE_QUADRANTS)}, got {value!r}")


def treatment_for(quadrant: Quadrant, options: TreatmentOptions) -> Treatment:
    """SILO requests are bound by inter-token latency, which speculation shortens; elsewhere the verification
    work mostly costs batch capacity. LILO requests hold the most KV the longest, so their old pages are the
    first to be compressed when the pool runs short."""
    speculate = None
    if options.speculation:
        speculate = quadrant is Quadrant.SILO or options.speculate_quadrants == "all"
    return Treatment(speculate=speculate, compress_first=options.kv_compress and quadrant is Quadrant.LILO,
                     long_prompt=quadrant in (Quadrant.LISO, Quadrant.LILO))
