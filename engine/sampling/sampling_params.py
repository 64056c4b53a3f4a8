"""Per-request sampling parameters, validated once at construction."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from engine.config import POOLING_MODES
from engine.sampling.fields import ApiName, Endpoint, Flag, Shape, sampling_field
from engine.sampling.thinking_budget import check_budget

if TYPE_CHECKING:
    from engine.sampling.structured import Guide

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


def _guide(value: Any) -> Guide:
    """A Guide, or its wire dict (Guide.to_wire) as one. Imported here: the command line reads the field
    declarations above without loading the grammar engine (and torch)."""
    from engine.sampling.structured import Guide, GuideError

    if isinstance(value, dict):
        try:
            return Guide.from_wire(value)
        except (GuideError, KeyError, TypeError) as e:
            raise SamplingParamsError("guide", f"guide is not a valid constraint: {e}") from None
    if not isinstance(value, Guide):
        raise SamplingParamsError("guide", f"guide must be a Guide, got {value!r}.")
    return value


def _thinking_budget(value: Any) -> tuple[int, int, int]:
    try:
        return check_budget(value)
    except ValueError as exc:
        raise SamplingParamsError("thinking_budget", str(exc)) from None


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, str):
        return (value,)
    return tuple(value) if value is not None else ()


@dataclass(frozen=True)
class SamplingParams:
    """How to turn next-token logits into tokens, and when to stop.

    Each field is declared once, here (engine/sampling/fields.py): the request fields that set it, its command
    line flag, whether a model's generation_config.json gives its default. The logit controls have vLLM's
    meanings: logit_bias adds to given tokens' logits before anything else; presence and frequency penalties
    subtract from the logits of tokens already generated (once, and once per occurrence); repetition_penalty
    divides the positive logits and multiplies the negative ones of tokens in the prompt or the output; min_p
    drops tokens less likely than min_p times the likeliest one.
    """

    n: int = sampling_field(1, Shape.INTEGER, ApiName("n", "samples per prompt"))
    max_tokens: int | None = sampling_field(
        16, Shape.INTEGER, ApiName("max_completion_tokens", "chat's name for max_tokens", (Endpoint.CHAT,)),
        ApiName("max_tokens", "output cap; chat defaults to the rest of the context or --default-max-tokens"),
        ApiName("n_predict", "llama.cpp server's name for max_tokens"),
        flag=Flag("most tokens to generate", 128))
    min_tokens: int = sampling_field(0, Shape.INTEGER, ApiName("min_tokens", "no stop before this many tokens"))
    temperature: float = sampling_field(
        1.0, Shape.NUMBER, ApiName("temperature", "sampling temperature; 0 is greedy"),
        flag=Flag("sampling temperature; 0 is greedy", 0.0), generation_config=True)
    top_p: float = sampling_field(
        1.0, Shape.NUMBER, ApiName("top_p", "nucleus sampling"),
        flag=Flag("nucleus sampling: smallest set of tokens whose probabilities reach this sum"),
        generation_config=True)
    top_k: int = sampling_field(
        -1, Shape.INTEGER, ApiName("top_k", "the k likeliest tokens only"),
        flag=Flag("sample among the k likeliest tokens; -1 is all"), generation_config=True)
    seed: int | None = sampling_field(None, Shape.SEED, ApiName("seed", "per-request seed"),
                                      flag=Flag("sampling seed", shown="random"))
    min_p: float = sampling_field(
        0.0, Shape.NUMBER, ApiName("min_p", "drop tokens less likely than min_p times the likeliest"),
        flag=Flag("drop tokens less likely than this times the likeliest one; 0 is off"), generation_config=True)
    stop: tuple[str, ...] = sampling_field((), Shape.STRINGS, ApiName("stop", "up to 16 stop strings"))
    stop_token_ids: tuple[int, ...] = sampling_field((), Shape.TOKEN_IDS, ApiName("stop_token_ids", "stop token ids"))
    ignore_eos: bool = sampling_field(False, Shape.BOOLEAN,
                                      ApiName("ignore_eos", "keep going past end-of-sequence tokens"))
    logprobs: int | None = sampling_field(  # top alternatives per token; None: no logprobs
        None, Shape.LOGPROBS, ApiName("logprobs", "completions: top alternatives per token; chat: a boolean"),
        ApiName("top_logprobs", "chat: top alternatives per token", (Endpoint.CHAT,)))
    skip_special_tokens: bool = sampling_field(
        True, Shape.BOOLEAN, ApiName("skip_special_tokens", "leave special tokens out of the text (default true)"))
    include_stop_str_in_output: bool = sampling_field(
        False, Shape.BOOLEAN, ApiName("include_stop_str_in_output", "keep the matched stop string in the text"))
    presence_penalty: float = sampling_field(
        0.0, Shape.NUMBER, ApiName("presence_penalty", "OpenAI's presence penalty"),
        flag=Flag("subtract this from the logits of tokens already generated (-2 to 2)"))
    frequency_penalty: float = sampling_field(
        0.0, Shape.NUMBER, ApiName("frequency_penalty", "OpenAI's frequency penalty"),
        flag=Flag("subtract this per earlier occurrence in the output (-2 to 2)"))
    repetition_penalty: float = sampling_field(
        1.0, Shape.NUMBER, ApiName("repetition_penalty", "vLLM's repetition penalty"),
        ApiName("repeat_penalty", "llama.cpp server's name for repetition_penalty", exclusive=True),
        flag=Flag("divide positive logits (multiply negative ones) of tokens in the prompt or output by this; "
                  "1 is off"), generation_config=True)
    logit_bias: tuple[tuple[int, float], ...] = sampling_field(  # (token id, bias) sorted by id; a dict is accepted
        (), Shape.TOKEN_BIAS, ApiName("logit_bias", "token id -> bias in [-100, 100]"))
    # Keep only the prompt's last k tokens (-1: the last max_model_len, which leaves no room for output as in
    # vLLM); applied where the prompt is tokenised (LLM, AsyncLLM, the server), so that the engine, the usage
    # and the length checks all see the kept tokens.
    truncate_prompt_tokens: int | None = sampling_field(
        None, Shape.INTEGER, ApiName("truncate_prompt_tokens", "keep only the prompt's last k tokens (-1: the "
                                                               "model's context length)"))
    # vLLM's prompt_logprobs: for each prompt position after the first, the logprob of the prompt's own token, its
    # rank and the k likeliest tokens there, from the model's fp32 logits in the prefill (engine/core/prompt_pass.py).
    # Such a prompt is recomputed, never read from the prefix cache: a cached prefix kept no logits.
    prompt_logprobs: int | None = sampling_field(
        None, Shape.INTEGER, ApiName("prompt_logprobs", "vLLM: each prompt token's logprob and the k likeliest "
                                                        "tokens at its position"))
    # An embedding request (FrontDoor.embedding): the prompt's final hidden states pooled into one L2-normalised
    # vector, "last" (token) or "mean"; the token it samples is not returned.
    pooling: str | None = sampling_field(None)
    # A grammar the output must follow (structured outputs); a wire dict is accepted (Guide.to_wire). Requests
    # spell it in several ways of their own (server/protocol.py).
    guide: Guide | None = sampling_field(None)
    # A budget of thinking tokens, (tokens, open token id or -1, close token id): past it the close tag is forced
    # (engine/sampling/thinking_budget.py). Requests set it through their API's own field (Anthropic's
    # thinking.budget_tokens).
    thinking_budget: tuple[int, int, int] | None = sampling_field(None)

    def __post_init__(self) -> None:
        if self.guide is not None:
            object.__setattr__(self, "guide", _guide(self.guide))
        if self.thinking_budget is not None:
            object.__setattr__(self, "thinking_budget", _thinking_budget(self.thinking_budget))
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._check_counts()
        self._check_truncation()
        self._check_distribution()
        self._check_penalties()
        self._check_stops()
        self._check_pooling()
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise SamplingParamsError(name, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.")

    def _check_truncation(self) -> None:
        keep = self.truncate_prompt_tokens
        if keep is None:
            return
        _require_int("truncate_prompt_tokens", keep)
        if keep < 1 and keep != -1:
            raise SamplingParamsError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the model's "
                                                                f"context length) or at least 1, got {keep}.")

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

    def _check_pooling(self) -> None:
        if self.pooling is None:
            return
        if self.pooling not in POOLING_MODES:
            raise SamplingParamsError("pooling", f"pooling must be one of {', '.join(POOLING_MODES)}, "
                                                 f"got {self.pooling!r}.")
        if self.n != 1:
            raise SamplingParamsError("n", f"an embedding takes n=1, got {self.n}.")

    @property
    def prompt_outputs(self) -> bool:
        """The request asks for what its prompt pass computes: prompt logprobs or an embedding."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def reads_every_prompt_position(self) -> bool:
        """Its prompt outputs need every prompt position's hidden state (prompt logprobs, mean pooling), so its
        prompt pass starts at position 0, not after a cached prefix."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Some penalty is on: sampling needs the tokens the sequence holds so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def masks_tokens(self) -> bool:
        """A grammar or a thinking budget may forbid tokens: sampling needs the output so far."""
        return self.guide is not None or self.thinking_budget is not None

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or biases move the logits, so even a greedy pick is not the raw argmax."""
        return self.penalised or bool(self.logit_bias)

    def truncated_prompt(self, token_ids: Sequence[int], max_model_len: int) -> list[int]:
        """The prompt's tokens that run: the last truncate_prompt_tokens of them (-1: the last max_model_len),
        all of them when it is unset."""
        if self.truncate_prompt_tokens is None:
            return list(token_ids)
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return list(token_ids[-keep:])

    def with_seed(self, seed: int | None) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)
