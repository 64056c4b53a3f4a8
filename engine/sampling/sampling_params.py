"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from engine.sampling.structured import Guide, GuideError

MAX_N = 128
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's do
MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _require_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}.")


def _require_number(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}.")


def _require_finite(name: str, value: Any) -> None:
    _require_number(name, value)
    if math.isinf(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value!r}.")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias, as (token id, float bias) pairs sorted by id."""
    if value is None:
        return ()
    try:
        pairs = list(value.items() if hasattr(value, "items") else value)
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to biases, got {value!r}.") from None
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}.")
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and not math.isnan(bias)
        if not ok or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias values must be numbers between {-MAX_LOGIT_BIAS:g} and "
                              f"{MAX_LOGIT_BIAS:g}, got {bias!r} for token {token}.")
    if len({token for token, _ in pairs}) != len(pairs):
        raise SamplingParamsError("logit_bias", "logit_bias names a token id twice.")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, str):
        return (value,)
    return tuple(value) if value is not None else ()


@dataclass(frozen=True)
class SamplingParams:
    """How to turn next-token logits into tokens, and when to stop."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Logit controls, with vLLM's meanings: presence and frequency penalties subtract from the logits of tokens
    # already generated (once, and once per occurrence); repetition_penalty divides the positive logits and
    # multiplies the negative ones of tokens in the prompt or the output; logit_bias adds to given tokens'
    # logits before anything else; min_p drops tokens less likely than min_p times the likeliest one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs sorted by id; a dict is accepted
    min_p: float = 0.0
    # A grammar the output must follow (structured outputs); a wire dict is accepted (Guide.to_wire).
    guide: Guide | None = None

    def __post_init__(self) -> None:
        if isinstance(self.guide, dict):
            try:
                object.__setattr__(self, "guide", Guide.from_wire(self.guide))
            except (GuideError, KeyError, TypeError) as e:
                raise SamplingParamsError("guide", f"guide is not a valid constraint: {e}") from None
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise SamplingParamsError("guide", f"guide must be a Guide, got {self.guide!r}.")
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._check_counts()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        if self.seed is not None:
            _require_int("seed", self.seed)

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError("n", f"n must be between 1 and {MAX_N}, got {self.n}.")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise SamplingParamsError(
                    "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}.")

    def _check_distribution(self) -> None:
        _require_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                "temperature", f"temperature must be between 0 and {MAX_TEMPERATURE}, got {self.temperature}.")
        _require_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}.")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require_number(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingParamsError(name, f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, "
                                                f"got {value}.")
        _require_finite("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.")
        _require_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be between 0 and 1, got {self.min_p}.")

    def _check_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {s!r}.")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise SamplingParamsError(
                    "stop_token_ids", f"stop_token_ids must be non-negative integers, got {t!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Some penalty is on: sampling needs the tokens the sequence holds so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases move the logits, so even a greedy pick is not the raw argmax."""
        return self.penalised or bool(self.logit_bias)

    def with_seed(self, seed: int | None) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)
