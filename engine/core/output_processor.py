"""Front-end side of generation: token updates from an engine become text, stop strings and timings."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling.sampler import TokenLogprobs
from engine.sampling.sampling_params import SamplingParams
from engine.speculative.adaptive import SpecCounts
from engine.core.step import PromptResult, SequenceUpdate
from engine.core.stop_checker import StopChecker
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    stops: StopChecker
    out: CompletionOutput
    spec: SpecCounts | None = None  # from the engine's finishing update of a speculating sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    emitted: bool = False  # an output has gone out (the first token is never held)
    last_output: float = 0.0  # when it went out (the processor's clock)
    # what the prompt pass computed, from the update of the first token (engine/core/prompt_pass.py)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.out.finished for s in self.samples)

    @property
    def spec(self) -> SpecCounts | None:
        counts = [s.spec for s in self.samples if s.spec is not None]
        return sum(counts, SpecCounts()) if counts else None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float | None = None) -> None:
        samples = [self._new_sample(i, params) for i in range(params.n)]
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, samples,
                                                 RequestMetrics(arrival_time or self.clock()))

    def _new_sample(self, index: int, params: SamplingParams) -> _Sample:
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        out = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        return _Sample(detok, StopChecker(params.stop, params.include_stop_str_in_output), out)

    def process(self, updates: list[SequenceUpdate], hold: int = 1, max_wait: float | None = None
                ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply updates; returns one output per changed request that is due (see `_due`: `hold` new tokens
        per output, or `max_wait` seconds since its last output) and the (request, sample) pairs to abort
        because a stop string ended them. A request that is not due keeps its deltas for a later output."""
        now = self.clock()
        to_abort: list[tuple[str, int]] = []
        touched: dict[str, RequestState] = {}
        for upd in updates:
            state = self.requests.get(upd.request_id)
            if state is None or state.samples[upd.sample_index].out.finished:
                continue
            if self._apply(state, upd, now):
                to_abort.append((upd.request_id, upd.sample_index))
            touched[upd.request_id] = state
        due = [state for state in touched.values() if _due(state, hold, max_wait, now)]
        return [self._emit(state, now) for state in due], to_abort

    def _apply(self, state: RequestState, upd: SequenceUpdate, now: float) -> bool:
        """Returns True when a stop string finished the sample (the engine must stop generating it)."""
        sample = state.samples[upd.sample_index]
        state.num_cached_tokens = upd.num_cached_tokens
        if upd.prompt is not None:
            self._record_prompt(state, upd.prompt)
        if upd.spec is not None:
            sample.spec = upd.spec
        if upd.token_id is not None:
            self._record_token(state, sample, upd, now)
        if sample.out.finish_reason is None and upd.finish_reason is not None:
            self._finish(sample, upd.finish_reason)
        return sample.stops.stopped and upd.finish_reason is None

    @staticmethod
    def _record_prompt(state: RequestState, prompt: PromptResult) -> None:
        if prompt.logprobs is not None:
            state.prompt_logprobs = list(prompt.logprobs)
        if prompt.embedding is not None:
            state.embedding = list(prompt.embedding)

    def _record_token(self, state: RequestState, sample: _Sample, upd: SequenceUpdate, now: float) -> None:
        out = sample.out
        out.token_ids.append(upd.token_id)
        out.delta_token_ids.append(upd.token_id)
        if upd.logprobs is not None and out.logprobs is not None:
            out.logprobs.append(upd.logprobs)
            out.delta_logprobs.append(upd.logprobs)
        if upd.sample_index == 0:
            state.metrics.token_times.append(now)
            state.metrics.first_token_time = state.metrics.first_token_time or now
        ends_by_token = upd.finish_reason == "stop" and upd.token_id in self._stop_ids(state.params)
        if ends_by_token:
            return
        safe, hit = sample.stops.feed(sample.detok.push(upd.token_id))
        self._append_text(out, safe)
        if hit:
            out.finish_reason, out.stop_reason = "stop", sample.stops.stop_reason

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | set(self.tokenizer.eos_token_ids)

    def _finish(self, sample: _Sample, reason: str) -> None:
        if not sample.stops.stopped:
            safe, hit = sample.stops.feed(sample.detok.flush())
            self._append_text(sample.out, safe + ("" if hit else sample.stops.flush()))
            reason = "stop" if hit else reason
            sample.out.stop_reason = sample.stops.stop_reason
        sample.out.finish_reason = reason

    @staticmethod
    def _append_text(out: CompletionOutput, text: str) -> None:
        out.text += text
        out.delta_text += text

    def _emit(self, state: RequestState, now: float) -> RequestOutput:
        outputs = [self._snapshot(sample.out) for sample in state.samples]
        state.emitted, state.last_output = True, now
        if state.finished:
            state.metrics.finished_time = now
            del self.requests[state.request_id]
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, state.metrics,
                             state.num_cached_tokens, state.finished, spec=state.spec,
                             prompt_logprobs=state.prompt_logprobs, embedding=state.embedding)

    @staticmethod
    def _snapshot(out: CompletionOutput) -> CompletionOutput:
        snap = CompletionOutput(out.index, out.text, list(out.token_ids), out.finish_reason,
                                None if out.logprobs is None else list(out.logprobs), out.delta_text,
                                out.delta_token_ids, out.delta_logprobs, stop_reason=out.stop_reason)
        out.delta_text, out.delta_token_ids, out.delta_logprobs = "", [], []
        return snap

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _due(state: RequestState, hold: int, max_wait: float | None, now: float) -> bool:
    """Whether a request's output goes out now: its first, any with a finish, `hold` new tokens in one sample,
    or any new token once `max_wait` seconds have passed since its last output (slow steps hold nothing)."""
    if hold <= 1 or not state.emitted or (max_wait is not None and now - state.last_output >= max_wait):
        return True
    return any(s.out.finish_reason is not None or len(s.out.delta_token_ids) >= hold for s in state.samples)
