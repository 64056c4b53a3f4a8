"""The chat route's own fields on /v1/messages: vLLM's and llama.cpp's extensions that Anthropic's API does not
spell (min_p, seed, the penalties, logit_bias, guided_*, chat_template_kwargs, enable_thinking, ...) are passed
to the chat parser by name, as /v1/responses passes them, so that they mean here what they mean on chat and the
chat fields it refuses are refused here too, by the same table.

Not passed: the chat spellings of a Messages field (`stop` is `stop_sequences` here, ...) and the fields whose
result a Messages reply has no place for (`n`, log-probabilities); each is a 400 naming it unless it holds its
default. The template variable `enable_thinking` may not contradict `thinking` (a 400 naming `thinking`).
"""
from __future__ import annotations

from typing import Any, Callable

from frontend.anthropic_messages import MESSAGES_FIELDS, MessagesError
from frontend.anthropic_thinking import Thinking
from server.request_fields import CHAT, IGNORED, REQUEST_FIELDS, field_name


def _other_than(*defaults: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in defaults


# chat field -> (why it is refused here, the values refused)
NOT_PASSED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "stop": ("on /v1/messages stop strings are spelled stop_sequences", _other_than()),
    "response_format": ("on /v1/messages the format is spelled output_config.format", _other_than()),
    "parallel_tool_calls": ("on /v1/messages it is spelled tool_choice.disable_parallel_tool_use", _other_than()),
    "max_completion_tokens": ("on /v1/messages the limit is spelled max_tokens", _other_than()),
    "n_predict": ("on /v1/messages the limit is spelled max_tokens", _other_than()),
    "n": ("a message holds one reply", _other_than(1)),
    "logprobs": ("a message has no place for log-probabilities", _other_than(False)),
    "top_logprobs": ("a message has no place for log-probabilities", _other_than(0)),
    "prompt_logprobs": ("a message has no place for log-probabilities", _other_than()),
    "add_generation_prompt": ("the chat template always opens the assistant's turn", _other_than(True)),
    "stream_options": ("a Messages stream always ends with its usage", lambda value: False),
}

PASSED_TO_CHAT: frozenset[str] = frozenset(
    field_name(key) for key, fate in REQUEST_FIELDS.items()
    if CHAT in fate.routes and fate.fate != IGNORED and field_name(key) not in MESSAGES_FIELDS
    and field_name(key) not in NOT_PASSED)


def with_chat_fields(body: dict[str, Any], chat: dict[str, Any], thinking: Thinking) -> dict[str, Any]:
    """`chat` (the translated body) with the chat route's own fields `body` gives; MessagesError naming the field
    for a chat spelling of a Messages field, a result with no place in a message, or a contradiction of
    `thinking`."""
    for name, (why, refused_if) in NOT_PASSED.items():
        if name in body and refused_if(body[name]):
            raise MessagesError(name, f"'{name}' is not supported on /v1/messages: {why}.")
    passed = {name: body[name] for name in PASSED_TO_CHAT if name in body}
    kwargs = passed.get("chat_template_kwargs")
    asked = [passed.get("enable_thinking"), kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None]
    if thinking.enabled is not None and any(v is not None and v != thinking.enabled for v in asked):
        raise MessagesError("thinking", "'thinking' and 'enable_thinking' (or chat_template_kwargs.enable_thinking) "
                                        "disagree; give one.")
    if isinstance(kwargs, dict) and "chat_template_kwargs" in chat:
        passed["chat_template_kwargs"] = kwargs | chat["chat_template_kwargs"]
    return passed | {key: value for key, value in chat.items() if key not in passed}
