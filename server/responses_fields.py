"""Every field of a /v1/responses body this server knows, with its fate, as server/request_fields.py keeps them
for chat and completions: implemented, refused (400 naming it) or ignored (it cannot change the output).

The chat route's own fields that Responses does not spell differently (vLLM's and llama.cpp's extensions:
top_k, min_p, seed, stop, the penalties, ignore_eos, guided_json, ...) are passed to the chat parser as they
are (`PASSED_TO_CHAT`), so that they mean on this route what they mean on chat, and the chat fields it
refuses are refused here too, by the same table. Fields in neither table are ignored, as OpenAI-compatible
servers do.
"""
from __future__ import annotations

from typing import Any, Callable

from server.errors import bad_request
from server.request_fields import CHAT, IGNORED, IMPLEMENTED, REFUSED, REQUEST_FIELDS, Fate, field_name


def _given(value: Any) -> bool:
    return value is not None and value != [] and value != {}


def _other_than(*defaults: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in defaults


def _impl(why: str) -> Fate:
    return Fate(IMPLEMENTED, why, (CHAT,))


def _refuse(why: str, refused_if: Callable[[Any], bool] = _given, example: Any = True) -> Fate:
    return Fate(REFUSED, why, (CHAT,), refused_if, example)


def _ignore(why: str) -> Fate:
    return Fate(IGNORED, why, (CHAT,))


RESPONSES_FIELDS: dict[str, Fate] = {
    "model": _impl("must name the served model"),
    "input": _impl("text, or message (text parts), function_call, function_call_output and reasoning items"),
    "instructions": _impl("a system message before the input (not carried over by previous_response_id)"),
    "tools": _impl("function tools, rendered through the chat template; other tool types are a 400"),
    "tool_choice": _impl("auto, none, required or a named function (the last two grammar-enforced)"),
    "parallel_tool_calls": _impl("false: at most one call"),
    "text": _impl("format: text, json_object or json_schema"),
    "max_output_tokens": _impl("the most tokens generated"),
    "temperature": _impl("sampling temperature"),
    "top_p": _impl("nucleus sampling"),
    "stream": _impl("typed server-sent events, each with its sequence_number"),
    "previous_response_id": _impl("continue a stored response's conversation"),
    "store": _impl("keep the response for GET and previous_response_id (bounded in count, bytes and age)"),
    "metadata": _impl("kept with the response and returned"),
    "background": _refuse("responses run in the foreground only (no background queue to poll or cancel)",
                          _other_than(False)),
    "include": _refuse("no extra outputs are included (logprobs, encrypted reasoning, tool sources)",
                       example=["message.output_text.logprobs"]),
    "top_logprobs": _refuse("log-probabilities are not returned on this route", _other_than(0), 2),
    "reasoning": _impl("effort none turns thinking off; other efforts and summary are a 400 "
                       "(server/responses_reasoning.py)"),
    "truncation": _refuse("the input is never truncated; a prompt longer than the context is a 400",
                          _other_than("disabled"), "auto"),
    "conversation": _refuse("conversations are not stored; use previous_response_id", example="conv_1"),
    "prompt": _refuse("stored prompt templates are not kept", example={"id": "pmpt_1"}),
    "max_tool_calls": _refuse("the number of calls is not capped; parallel_tool_calls false allows one",
                              example=1),
    "context_management": _refuse("context compaction is not implemented", example=[{"type": "compaction"}]),
    "background_options": _refuse("responses run in the foreground only", example={"x": 1}),
    "moderation": _refuse("no moderation runs", example={"x": 1}),
    "image": _refuse("only text is generated", example={"x": 1}),
    "access_programs": _refuse("programmatic tool calling is not implemented", example={"x": 1}),
    # chat spellings with a Responses spelling of their own
    "max_tokens": _refuse("on /v1/responses the limit is spelled max_output_tokens", example=16),
    "max_completion_tokens": _refuse("on /v1/responses the limit is spelled max_output_tokens", example=16),
    "n_predict": _refuse("on /v1/responses the limit is spelled max_output_tokens", example=16),
    "messages": _refuse("on /v1/responses the conversation is sent as input",
                         example=[{"role": "user", "content": "hi"}]),
    "response_format": _refuse("on /v1/responses the format is sent as text.format", example={"type": "text"}),
    "n": _refuse("a response holds one output", _other_than(1), 2),
    "logprobs": _refuse("log-probabilities are not returned on this route", _other_than(False)),
    "add_generation_prompt": _refuse("the input always ends with the assistant's turn opening", _other_than(True),
                                     False),
    # ignored: they cannot change the output
    "stream_options": _ignore("include_obfuscation only pads events"),
    "user": _ignore("an end-user id for abuse monitoring"),
    "safety_identifier": _ignore("an end-user id for abuse monitoring"),
    "service_tier": _ignore("one tier"),
    "prompt_cache_key": _ignore("prefix caching is always on, keyed by the tokens"),
    "prompt_cache_retention": _ignore("prefix caching is always on"),
    "prompt_cache_options": _ignore("prefix caching is always on"),
}

# The chat route's fields that mean the same here, passed on to the chat parser by name.
PASSED_TO_CHAT: frozenset[str] = frozenset(
    field_name(key) for key, fate in REQUEST_FIELDS.items()
    if CHAT in fate.routes and fate.fate != IGNORED and field_name(key) not in RESPONSES_FIELDS)


def refuse_unsupported(body: dict[str, Any]) -> None:
    """400 naming the first field in `body` whose value /v1/responses refuses."""
    for name, fate in RESPONSES_FIELDS.items():
        if fate.fate == REFUSED and name in body and fate.refused_if(body[name]):
            raise bad_request(f"'{name}' is not supported on /v1/responses: {fate.why}.", name,
                              "unsupported_parameter")
