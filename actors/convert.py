"""Between engine objects and wire messages (the only place that knows both shapes)."""
from __future__ import annotations

import struct
from dataclasses import asdict

from engine.sampling.sampler import TokenLogprobs
from engine.sampling.sampling_params import SamplingParams
from engine.speculative.adaptive import SpecCounts
from engine.core.step import PromptResult, SequenceUpdate
from transport import messages as m


def params_to_wire(params: SamplingParams) -> dict:
    """Tuples as lists, logit_bias as [[token id, bias], ...] (msgpack maps take only str keys), the guide as
    its source text (Guide.to_wire: the receiver compiles it)."""
    wire = {k: [list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v
            for k, v in asdict(params).items()}
    wire["guide"] = None if params.guide is None else params.guide.to_wire()
    return wire


def params_from_wire(raw: dict) -> SamplingParams:
    return SamplingParams(**raw)


def resume_to_wire(resume: dict[int, list[int]] | None) -> list[list] | None:
    """A resumed stream's emitted tokens per sample as [[sample index, tokens], ...] (msgpack map keys are str)."""
    return None if resume is None else [[i, list(tokens)] for i, tokens in sorted(resume.items())]


def resume_from_wire(raw: list[list] | None) -> dict[int, list[int]] | None:
    return None if raw is None else {int(i): [int(t) for t in tokens] for i, tokens in raw}


def logprobs_to_wire(lp: TokenLogprobs | None) -> tuple[float | None, list[m.TopLogprob] | None]:
    if lp is None:
        return None, None
    return lp.logprob, [m.TopLogprob(token_id, logprob) for token_id, logprob in lp.top]


def logprobs_from_wire(token_id: int | None, logprob: float | None,
                       top: list[m.TopLogprob] | None) -> TokenLogprobs | None:
    if logprob is None or token_id is None:
        return None
    return TokenLogprobs(token_id, logprob, [(t.token_id, t.logprob) for t in top or []])


def spec_to_wire(spec: SpecCounts | None) -> m.SpecCount | None:
    if spec is None:
        return None
    return m.SpecCount(spec.num_draft_proposed, spec.num_draft_accepted, spec.num_verify_steps)


def spec_from_wire(spec: m.SpecCount | None) -> SpecCounts | None:
    return None if spec is None else SpecCounts(spec.proposed, spec.accepted, spec.steps)


def prompt_logprobs_to_wire(entries: tuple[TokenLogprobs | None, ...] | None) -> list[m.PromptLogprob] | None:
    """Positions 1.. (position 0 has no logprob)."""
    if entries is None:
        return None
    return [m.PromptLogprob(e.token_id, e.logprob, e.rank or 0, [m.TopLogprob(t, lp) for t, lp in e.top])
            for e in entries[1:]]


def prompt_logprobs_from_wire(rows: list[m.PromptLogprob] | None) -> tuple[TokenLogprobs | None, ...] | None:
    if rows is None:
        return None
    return (None, *(TokenLogprobs(r.token_id, r.logprob, [(t.token_id, t.logprob) for t in r.top_logprobs], r.rank)
                    for r in rows))


def embedding_to_wire(embedding: tuple[float, ...] | None) -> bytes | None:
    """Little-endian float32: the values are fp32, so the bytes carry them exactly."""
    return None if embedding is None else struct.pack(f"<{len(embedding)}f", *embedding)


def embedding_from_wire(raw: bytes | None) -> tuple[float, ...] | None:
    if raw is None:
        return None
    if len(raw) % 4:
        raise ValueError(f"an embedding of {len(raw)} bytes is not float32 values")
    return struct.unpack(f"<{len(raw) // 4}f", raw)


def prompt_to_wire(prompt: PromptResult | None) -> tuple[list[m.PromptLogprob] | None, bytes | None]:
    if prompt is None:
        return None, None
    return prompt_logprobs_to_wire(prompt.logprobs), embedding_to_wire(prompt.embedding)


def prompt_from_wire(u: m.TokenUpdate) -> PromptResult | None:
    if u.prompt_logprobs is None and u.embedding is None:
        return None
    return PromptResult(prompt_logprobs_from_wire(u.prompt_logprobs), embedding_from_wire(u.embedding))


def update_to_wire(u: SequenceUpdate) -> m.TokenUpdate:
    logprob, top = logprobs_to_wire(u.logprobs)
    return m.TokenUpdate(u.request_id, u.sample_index, u.token_id, u.finish_reason, logprob, top,
                         u.num_prompt_tokens, u.num_cached_tokens, spec_to_wire(u.spec), *prompt_to_wire(u.prompt))


def update_from_wire(u: m.TokenUpdate) -> SequenceUpdate:
    return SequenceUpdate(u.request_id, u.sample_index, u.token_id, u.finish_reason,
                          logprobs_from_wire(u.token_id, u.logprob, u.top_logprobs),
                          u.num_prompt_tokens, u.num_cached_tokens, spec_from_wire(u.spec), prompt=prompt_from_wire(u))
