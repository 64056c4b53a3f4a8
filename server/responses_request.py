"""A /v1/responses body translated into the chat request the chat route prepares, so that tools, constraints,
templates, sampling fields and stop handling are read and checked once, by the chat parser.

The chat parser names chat fields in its errors; `responses_names` turns them into the Responses spellings
(max_tokens -> max_output_tokens, response_format -> text.format, messages -> input), so that a 400 on this
route names the field the client sent.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from frontend.responses_items import (Item, ItemError, chat_messages, chat_response_format, chat_tool_choice,
                                      chat_tools, input_items)
from server.errors import ApiError, bad_request, invalid_type
from server.protocol import GenerationRequest, RequestDefaults, check_model_name, parse_chat
from server.responses_fields import PASSED_TO_CHAT, refuse_unsupported
from server.responses_reasoning import parse_reasoning
from server.responses_store import StoredResponse

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits on metadata
_RENAMES = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input"))
_CHAT_CHOICE = '{"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ResponsesRequest:
    chat: GenerationRequest  # what the chat route would run
    conversation: tuple[Item, ...]  # the earlier turns' items and this turn's input (what a later turn continues)
    echo: dict[str, Any]  # the request's settings as the Response object repeats them
    store: bool

    @property
    def stream(self) -> bool:
        return self.chat.stream


Lookup = Callable[[str], StoredResponse | None]


def parse_responses(body: dict[str, Any], served_model: str, defaults: RequestDefaults,
                    lookup: Lookup) -> ResponsesRequest:
    """400 naming the field for anything this server cannot honour; 404 naming previous_response_id for an id
    the store does not hold (for this credential)."""
    model = _typed(body, "model", str, "a string", served_model)
    check_model_name(model, served_model)
    refuse_unsupported(body)
    instructions = _typed(body, "instructions", str, "a string", None)
    previous_id = _typed(body, "previous_response_id", str, "a string", None)
    history = _history(previous_id, lookup)
    reasoning = parse_reasoning(body.get("reasoning"))
    try:
        if body.get("input") is None:
            raise ItemError("input", "'input' is required.")
        conversation = history + input_items(body["input"])
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat_body = _chat_body(body, system + chat_messages(conversation)) | reasoning.chat_fields(body)
    except ItemError as exc:
        raise bad_request(str(exc), exc.param) from None
    with responses_names():
        chat = parse_chat(chat_body, served_model, defaults)
    echo = _echo(body, chat, instructions, previous_id) | {"reasoning": reasoning.echo()}
    return ResponsesRequest(chat, tuple(conversation), echo, echo["store"])


def _history(previous_id: str | None, lookup: Lookup) -> list[Item]:
    if previous_id is None:
        return []
    stored = lookup(previous_id)
    if stored is None:
        raise ApiError(404, f"'previous_response_id': there is no stored response '{previous_id}': it was never "
                       "stored here (store: false), was deleted, has expired, or belongs to another API key.",
                       "previous_response_id", "previous_response_not_found")
    return stored.conversation()


def _chat_body(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    text = body.get("text")
    if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
        raise ItemError("text.verbosity", "'text.verbosity' is not supported: the model's length is not steered "
                                          "(leave it out, or medium).")
    translated = {"model": body.get("model"), "messages": messages, "stream": body.get("stream"),
                  "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
                  "top_p": body.get("top_p"), "tools": chat_tools(body.get("tools")),
                  "tool_choice": chat_tool_choice(body.get("tool_choice")),
                  "parallel_tool_calls": body.get("parallel_tool_calls"),
                  "response_format": chat_response_format(text)}
    passed = {name: body[name] for name in PASSED_TO_CHAT if name in body}
    return passed | {key: value for key, value in translated.items() if value is not None}


def _echo(body: dict[str, Any], chat: GenerationRequest, instructions: str | None,
          previous_id: str | None) -> dict[str, Any]:
    params = chat.sampling.params
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": _metadata(body.get("metadata")), "parallel_tool_calls": chat.parallel_tool_calls,
            "previous_response_id": previous_id, "store": _typed(body, "store", bool, "a boolean", True),
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": _choice_echo(body.get("tool_choice"), chat), "tools": list(body.get("tools") or []),
            "truncation": "disabled", "reasoning": {"effort": None, "summary": None}, "top_logprobs": 0,
            "max_tool_calls": None, "service_tier": "default", "user": body.get("user")}


def _choice_echo(given: Any, chat: GenerationRequest) -> Any:
    return given if given is not None else chat.tool_choice.mode


def _metadata(value: Any) -> dict[str, str]:
    """At most 16 string pairs, keys up to 64 characters and values up to 512, as OpenAI takes them."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid_type("metadata", "an object of strings", value)
    too_long = [k for k, v in value.items() if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE]
    if len(value) > MAX_METADATA_KEYS or too_long:
        raise bad_request(f"'metadata' holds at most {MAX_METADATA_KEYS} pairs, keys of up to {MAX_METADATA_KEY} "
                          f"characters and values of up to {MAX_METADATA_VALUE}.", "metadata")
    return dict(value)


def _typed(body: dict[str, Any], name: str, kind: type, expected: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid_type(name, expected, value)
    return value


# ---------------------------------------------------------------------------------------- error names

def renamed(err: ApiError) -> ApiError:
    """The chat parser's error with the fields spelled as /v1/responses spells them."""
    message = err.message.replace(_CHAT_CHOICE, '{"type": "function", "name": ...}')
    param, message = err.param, message.replace("the messages hold", "the input holds")
    message = re.sub(r"(tools\[\d+\])\.function\.", r"\1.", message)
    for chat_name, name in _RENAMES:
        if param is not None and re.match(rf"{chat_name}(?![A-Za-z_])", param):
            param = name + param[len(chat_name):]
        message = re.sub(rf"(?<![A-Za-z_]){chat_name}(?![A-Za-z_])", name, message)
    if (param, message) == (err.param, err.message):
        return err
    return ApiError(err.status, message, param, err.code, err.headers)


@contextmanager
def responses_names() -> Iterator[None]:
    """Re-raises an ApiError from the chat path with the Responses spellings of the fields it names."""
    try:
        yield
    except ApiError as err:
        raise renamed(err) from None
