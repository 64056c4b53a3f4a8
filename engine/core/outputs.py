"""What the engine hands back to its callers: per-request outputs with text, tokens and timings."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling.sampler import TokenLogprobs
from engine.speculative.adaptive import SpecCounts


@dataclass(frozen=True)
class ToolCall:
    """A function call read out of a sample's text (chat with tools)."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class CompletionOutput:
    """One of a request's n samples. text/token_ids are cumulative; the delta_ fields are new this update."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # chat with tools or a reasoning model (LLM, or AsyncLLM's last output): the calls read out of `text` (None:
    # no tools offered), the text before them, and the thinking before the answer (None: none).
    tool_calls: list[ToolCall] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    stop_reason: str | None = None  # the stop string that ended the sample (finish_reason "stop"); None otherwise

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def after(self, earlier: CompletionOutput) -> CompletionOutput:
        """This output with `earlier`'s deltas in front of its own: the two successive outputs as one."""
        return CompletionOutput(self.index, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                earlier.delta_text + self.delta_text, earlier.delta_token_ids + self.delta_token_ids,
                                earlier.delta_logprobs + self.delta_logprobs, stop_reason=self.stop_reason)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each output token (first sample)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finished: bool = False
    path: str = "colocated"  # colocated | disaggregated
    placement: str = "colocated; in-process"  # the decision and its estimates, for the X-Placement header
    spec: SpecCounts | None = None  # speculative decoding, summed over the samples that finished; None: none did
    trace: tuple[float, ...] = ()  # token tracing: step done, sent, received, detokenised (time.monotonic())
    moves: tuple[str, ...] = ()  # the stream's migrations between decode actors ("decode-0->decode-1")
    # SamplingParams.prompt_logprobs: per prompt position, None at the first, then the prompt token's logprob,
    # rank and the likeliest tokens there (None: not asked for, or not computed yet)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None  # an embedding request's L2-normalised vector (EmbeddingOutput)

    def after(self, earlier: RequestOutput) -> RequestOutput:
        """This output merged with the one before it, as if the two had gone out as one."""
        outputs = [o.after(e) for o, e in zip(self.outputs, earlier.outputs)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.metrics,
                             self.num_cached_tokens, self.finished, self.path, self.placement, self.spec,
                             self.trace, self.moves, self.prompt_logprobs or earlier.prompt_logprobs,
                             self.embedding or earlier.embedding)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (`LLM.embed`, `AsyncLLM.embed`): its final hidden states pooled as the engine's
    `pooling` says (last token or mean), L2-normalised, fp32 values."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (last-token pooling only)

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingOutput:
        """The embedding a finished embedding request produced."""
        if out.embedding is None:
            raise ValueError(f"request {out.request_id} finished without an embedding")
        return cls(out.request_id, out.prompt_token_ids, out.embedding, out.num_cached_tokens)
