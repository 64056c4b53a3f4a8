"""Measured costs of an actor's phases, fitted from calibration samples and refreshed from live traffic.

Prefill seconds for n new tokens: a + b*n + c*n^2 (the quadratic term is attention over the prompt).
Decode step seconds for a batch of B sequences: d0 + d1*B.
Hand-off seconds for a number of bytes: latency + bytes / bandwidth, per link learnt from the transfers on it.

Both fits take only the points of a curve that never falls (engine.core.calibration.monotonic_points): a timing
below an earlier, smaller one is noise, and fitted it would bend the curve down.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from engine.core.calibration import monotonic_points


@dataclass(frozen=True)
class PrefillCost:
    fixed: float
    per_token: float
    per_token_sq: float = 0.0

    def seconds(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.fixed + self.per_token * num_tokens + self.per_token_sq * num_tokens ** 2

    @staticmethod
    def fit(samples: list[tuple[int, float]]) -> "PrefillCost":
        """Least squares over the monotonic (tokens, seconds) samples; coefficients are clipped at zero."""
        samples = monotonic_points(samples)[0]
        n = np.array([s[0] for s in samples], dtype=np.float64)
        t = np.array([s[1] for s in samples], dtype=np.float64)
        design = np.stack([np.ones_like(n), n, n * n], axis=1)
        coef = np.linalg.lstsq(design, t, rcond=None)[0] if len(samples) >= 3 else [0.0, (t / n).mean(), 0.0]
        return PrefillCost(*(max(float(c), 0.0) for c in coef))


@dataclass(frozen=True)
class DecodeCost:
    fixed: float
    per_seq: float

    def step_seconds(self, batch: int) -> float:
        return self.fixed + self.per_seq * max(batch, 1)

    @staticmethod
    def fit(samples: list[tuple[int, float]]) -> "DecodeCost":
        samples = monotonic_points(samples)[0]
        b = np.array([s[0] for s in samples], dtype=np.float64)
        t = np.array([s[1] for s in samples], dtype=np.float64)
        if len(samples) < 2:
            return DecodeCost(float(t.mean()), 0.0)
        slope, intercept = np.polyfit(b, t, 1)
        return DecodeCost(max(float(intercept), 0.0), max(float(slope), 0.0))


@dataclass(frozen=True)
class TransferCost:
    latency: float
    bytes_per_second: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency + num_bytes / self.bytes_per_second


@dataclass(frozen=True)
class LinkEstimate:
    """A link's transfer cost, learnt from its transfers: an exponentially weighted mean of seconds per byte over
    transfers of at least MIN_LINK_SAMPLE_BYTES (smaller ones are mostly latency), starting from `prior`."""

    prior: TransferCost
    seconds_per_byte: float | None = None
    samples: int = 0
    weight: float = 0.2

    def observe(self, num_bytes: int, seconds: float) -> "LinkEstimate":
        if num_bytes < MIN_LINK_SAMPLE_BYTES or seconds <= 0:
            return self
        sample = max(seconds - self.prior.latency, 0.0) / num_bytes
        mean = sample if self.seconds_per_byte is None else \
            (1 - self.weight) * self.seconds_per_byte + self.weight * sample
        return replace(self, seconds_per_byte=mean, samples=self.samples + 1)

    @property
    def cost(self) -> TransferCost:
        if self.seconds_per_byte is None:
            return self.prior
        return TransferCost(self.prior.latency, 1.0 / self.seconds_per_byte if self.seconds_per_byte else float("inf"))


MIN_LINK_SAMPLE_BYTES = 1 << 20  # a transfer this large is bandwidth-bound on any link worth disaggregating over


@dataclass(frozen=True)
class Smoothed:
    """An exponentially weighted correction factor for a cost estimate: observed / predicted."""

    ratio: float = 1.0
    weight: float = 0.1

    def observe(self, predicted: float, observed: float) -> "Smoothed":
        if predicted <= 0 or observed <= 0:
            return self
        sample = min(max(observed / predicted, 0.1), 10.0)  # one outlier must not swing the model
        return replace(self, ratio=(1 - self.weight) * self.ratio + self.weight * sample)


@dataclass(frozen=True)
class ArrivalRate:
    """Requests per second, from an exponentially weighted mean of the gaps between arrivals."""

    mean_gap: float | None = None  # seconds
    last: float | None = None  # monotonic time of the latest arrival
    weight: float = 0.1

    def observe(self, now: float) -> "ArrivalRate":
        if self.last is None:
            return replace(self, last=now)
        gap = max(now - self.last, 0.0)
        mean = gap if self.mean_gap is None else (1 - self.weight) * self.mean_gap + self.weight * gap
        return replace(self, mean_gap=mean, last=now)

    @property
    def rate(self) -> float:
        return 0.0 if not self.mean_gap else 1.0 / self.mean_gap
