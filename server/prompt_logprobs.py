"""The prompt's log-probabilities in a response (SamplingParams.prompt_logprobs, computed in the prefill):
vLLM's `prompt_logprobs` field, and the prompt's part of a legacy completion's `logprobs` with `echo`.

vLLM's shape, per prompt position: None at the first (nothing predicts it), then `{token id: {"logprob", "rank",
"decoded_token"}}` holding the prompt's own token (its rank among the whole vocabulary) and the k likeliest
tokens (ranks 1..k). On completions it is each choice's field, on chat the response's, as vLLM puts them; a
stream does not carry it (vLLM refuses the pair too).
"""
from __future__ import annotations

from typing import Any, Sequence

from engine.core.outputs import RequestOutput
from engine.model.tokenizer import Tokenizer
from engine.sampling.sampler import TokenLogprobs
from server.responses import Json, completion_logprobs, finite, token_text


def vllm_prompt_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs | None], top: int) -> list[Any]:
    """vLLM's list for one prompt, with the `top` likeliest tokens at each position."""
    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        row = {str(e.token_id): _entry(tokenizer, e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top[:top], 1):
            row.setdefault(str(token_id), _entry(tokenizer, token_id, logprob, rank))
        out.append(row)
    return out


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int | None) -> Json:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": token_text(tokenizer, token_id)}


def echo_logprobs(tokenizer: Tokenizer, prompt_token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                  top: int) -> Json:
    """The prompt's part of a legacy `logprobs` object: its tokens from offset 0, null logprob and alternatives
    for the first, then each token's logprob and the `top` likeliest (the token itself always among them)."""
    first = token_text(tokenizer, prompt_token_ids[0])
    rest = completion_logprobs(tokenizer, [TokenLogprobs(e.token_id, e.logprob, e.top[:top]) for e in entries[1:]],
                               len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def after_prompt(prompt_part: Json, completion_part: Json) -> Json:
    """One legacy `logprobs` object: the prompt's tokens, then the completion's, its offsets moved past the
    prompt's text."""
    shift = sum(len(t) for t in prompt_part["tokens"])
    moved = dict(completion_part, text_offset=[o + shift for o in completion_part["text_offset"]])
    return {key: prompt_part[key] + moved[key] for key in prompt_part}


def echoed(tokenizer: Tokenizer, out: RequestOutput, logprobs: Json, top: int) -> Json:
    """A completion choice's `logprobs` with the prompt's in front (echo with logprobs)."""
    if out.prompt_logprobs is None:
        raise RuntimeError(f"request {out.request_id} asked for echo with logprobs and got no prompt logprobs")
    return after_prompt(echo_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, top), logprobs)


def add_prompt_logprobs(body: Json, out: RequestOutput, tokenizer: Tokenizer, *, chat: bool, echo_top: int | None,
                        vllm_top: int | None) -> Json:
    """A whole response `body` of one prompt with what it asked of the prompt's logprobs: `echo_top` (echo with
    logprobs: the completion choices' logprobs start with the prompt's) and `vllm_top` (vLLM's field)."""
    if vllm_top is not None and out.prompt_logprobs is not None:
        listed = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs, vllm_top)
        if chat:
            body["prompt_logprobs"] = listed
        for choice in [] if chat else body["choices"]:
            choice["prompt_logprobs"] = listed
    if echo_top is not None and not chat:
        for choice in body["choices"]:
            choice["logprobs"] = echoed(tokenizer, out, choice["logprobs"], echo_top)
    return body
