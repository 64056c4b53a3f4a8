"""Response bodies and stream chunks in OpenAI's exact shapes, built from the engine's outputs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from engine.core.outputs import CompletionOutput, RequestOutput, ToolCall
from engine.sampling.sampler import TokenLogprobs
from engine.model.tokenizer import Tokenizer
from frontend.output import ReasoningOutput, ToolCallOutput, read_reply, thinking_tokens

Json = dict[str, Any]
LOGPROB_FLOOR = -9999.0  # stands in for -inf / NaN, which JSON cannot carry


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int
    model: str


def usage(prompt_tokens: int, outputs: Sequence[CompletionOutput], cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> Json:
    """The prompt counts once; completion tokens are summed over the n samples. `cached_tokens`: prompt tokens
    whose KV came from the prefix cache (OpenAI's prompt_tokens_details). `reasoning_tokens`: the completion
    tokens spent thinking, for a model that thinks (completion_tokens_details)."""
    completion = sum(len(o.token_ids) for o in outputs)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def output_usage(out: RequestOutput, outputs: Sequence[CompletionOutput] | None = None,
                 reasoning_tokens: int | None = None) -> Json:
    """usage() of one engine request; `outputs`: the samples to count, if not all of out's."""
    return usage(len(out.prompt_token_ids), out.outputs if outputs is None else outputs, out.num_cached_tokens,
                 reasoning_tokens)


def reasoning_usage(out: RequestOutput, tokenizer: Tokenizer, reasoning: ReasoningOutput | None) -> int | None:
    """The thinking tokens of a finished request's samples, summed; None for a model that does not think."""
    if reasoning is None:
        return None
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731 - the tags spelled out
    return sum(thinking_tokens(o.token_ids, o.text, reasoning, decode) for o in out.outputs)


def summed_usage(parts: Sequence[Json]) -> Json:
    """The usage of a completion request with several prompts: every count summed over its prompts."""
    total = {key: sum(p[key] for p in parts) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(p["prompt_tokens_details"]["cached_tokens"] for p in parts)
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def model_card(model: str, created: int, max_model_len: int, defaults: Json | None = None) -> Json:
    """OpenAI's model object; `defaults`: the sampling defaults requests get where they leave fields out, and
    where they come from."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "phase-serve",
            "max_model_len": max_model_len}
    if defaults is not None:
        card["defaults"] = defaults
    return card


def model_list(model: str, created: int, max_model_len: int, defaults: Json | None = None) -> Json:
    return {"object": "list", "data": [model_card(model, created, max_model_len, defaults)]}


# ---------------------------------------------------------------------------------------- token strings

def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # The token's own text (special tokens spelled out); a byte that is part of a UTF-8 character decodes as U+FFFD.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False, so it lands here too


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> Json:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


# ---------------------------------------------------------------------------------------- completions

def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs], start_offset: int = 0) -> Json:
    """Legacy shape: parallel lists; `top_logprobs` maps token text to logprob and always holds the sampled
    token; `text_offset` is each token's character offset in the completion text."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets, offset = [], start_offset
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [finite(e.logprob) for e in entries],
            "top_logprobs": [_top_dict(tokenizer, e, text) for e, text in zip(entries, tokens)],
            "text_offset": offsets}


def _top_dict(tokenizer: Tokenizer, entry: TokenLogprobs, sampled_text: str) -> dict[str, float]:
    # Tokens that spell the same text (e.g. lone UTF-8 bytes, all U+FFFD) share a key: the sampled token's
    # logprob wins, then the likelier alternative.
    top = {sampled_text: finite(entry.logprob)}
    for token_id, logprob in entry.top:
        top.setdefault(token_text(tokenizer, token_id), finite(logprob))
    return top


def completion_choice(tokenizer: Tokenizer, out: CompletionOutput, text: str, entries: Sequence[TokenLogprobs] | None,
                      start_offset: int = 0) -> Json:
    logprobs = None if entries is None else completion_logprobs(tokenizer, entries, start_offset)
    return {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}


def completion_body(meta: ResponseMeta, final: RequestOutput, tokenizer: Tokenizer, echo: str | None = None) -> Json:
    choices = [completion_choice(tokenizer, o, (echo or "") + o.text, o.logprobs) for o in final.outputs]
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": choices, "usage": output_usage(final), "system_fingerprint": None}


def completion_chunk(meta: ResponseMeta, choices: list[Json], with_usage_field: bool) -> Json:
    chunk = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
             "choices": choices, "system_fingerprint": None}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


# ---------------------------------------------------------------------------------------- chat

def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> Json:
    content = [{**_token_entry(tokenizer, e.token_id, e.logprob),
                "top_logprobs": [_token_entry(tokenizer, tid, lp) for tid, lp in e.top]} for e in entries]
    return {"content": content}


def best_of_outputs(final: RequestOutput, n: int, keep_logprobs: bool) -> RequestOutput:
    """The n samples with the highest cumulative logprob, best first, indexed 0..n-1."""
    ranked = sorted(final.outputs, key=lambda o: -sum(e.logprob for e in o.logprobs or ()))
    best = [dataclasses.replace(o, index=i, logprobs=o.logprobs if keep_logprobs else None)
            for i, o in enumerate(ranked[:n])]
    return dataclasses.replace(final, outputs=best)


def tool_call_json(call: ToolCall) -> Json:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_choice(tokenizer: Tokenizer, out: CompletionOutput, tools: ToolCallOutput | None = None,
                reasoning: ReasoningOutput | None = None) -> Json:
    """The choice of one sample; a model that thinks has its thinking in `reasoning_content` (vLLM's name)."""
    logprobs = None if out.logprobs is None else chat_logprobs(tokenizer, out.logprobs)
    reply = read_reply(out.text, out.finish_reason, tools, reasoning)
    # Without calls or thinking, the content is the text as it is ("" included).
    content = reply.content if reply.tool_calls or reasoning is not None else out.text
    message: Json = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    reason = out.finish_reason
    if reply.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
        reason = "tool_calls" if reason == "stop" else reason
    return {"index": out.index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def chat_body(meta: ResponseMeta, final: RequestOutput, tokenizer: Tokenizer,
              tools: ToolCallOutput | None = None, reasoning: ReasoningOutput | None = None) -> Json:
    return {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
            "choices": [chat_choice(tokenizer, o, tools, reasoning) for o in final.outputs],
            "usage": output_usage(final, reasoning_tokens=reasoning_usage(final, tokenizer, reasoning)),
            "system_fingerprint": None}


def chat_delta_choice(tokenizer: Tokenizer, out: CompletionOutput, wants_logprobs: bool,
                      finish_reason: str | None) -> Json:
    logprobs = chat_logprobs(tokenizer, out.delta_logprobs) if wants_logprobs else None
    delta = {"content": out.delta_text} if out.delta_text else {}
    return {"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_role_choice(index: int) -> Json:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def chat_chunk(meta: ResponseMeta, choices: list[Json], with_usage_field: bool) -> Json:
    chunk = {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
             "choices": choices, "system_fingerprint": None}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(meta: ResponseMeta, chat: bool, usage_body: Json) -> Json:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage_body, "system_fingerprint": None}
