"""A conversation (and the tools it offers) rendered with the model's chat template."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jinja2

from engine.model.tokenizer import Tokenizer
from frontend.tool_format import ToolFormat
from frontend.tool_prompts import template_renders_tools, tool_messages
from frontend.tools import Tool


# Variables the renderer sets itself, which template_kwargs may not name.
RESERVED_KWARGS = ("messages", "add_generation_prompt", "tools")


class ChatTemplateError(ValueError):
    """The chat template refused the messages (a role order it does not allow, a message it cannot take)."""


def check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    """ValueError naming a variable of `kwargs` that the renderer sets itself."""
    taken = [k for k in RESERVED_KWARGS if k in kwargs]
    if taken:
        raise ValueError(f"the chat template's {taken[0]!r} is set by the server; it cannot be passed as a "
                         f"template variable")


def uses_tools(messages: Sequence[dict[str, Any]], tools: Sequence[Tool]) -> bool:
    """Whether the conversation offers tools or holds earlier calls or tool results."""
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def render_chat(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[Tool], fmt: ToolFormat,
                add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `messages` (Hugging Face's shape) offering `tools`; earlier calls are written in
    `fmt` where the template does not render tools itself. `template_kwargs`: extra variables the template may
    read (enable_thinking, ...; one it does not read changes nothing). ChatTemplateError when the template
    refuses."""
    check_template_kwargs(template_kwargs or {})
    rendered, extra = list(messages), {}
    if uses_tools(messages, tools):
        rendered, extra = tool_messages(messages, tools, fmt, template_renders_tools(tokenizer.chat_template))
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                             **{**(template_kwargs or {}), **extra})
    except (jinja2.TemplateError, ValueError) as exc:
        raise ChatTemplateError(f"the messages cannot be rendered with this model's chat template: {exc}") from None
