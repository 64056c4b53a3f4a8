"""Tools and earlier calls in the prompt.

A chat template that mentions `tools` gets them as Hugging Face passes them (`tools=` of the template,
assistant messages with `tool_calls`, `tool` messages with `tool_call_id`). A template that does not is given
a system message listing the tools in the format's own words (Qwen2.5's wording for hermes, Llama 3.1's for
llama3, Mistral's `[AVAILABLE_TOOLS]` for mistral), appended to the first system message if there is one;
earlier assistant calls are written into their content as the format spells them, and tool results become
user messages inside `<tool_response>` tags.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from frontend.json_scan import is_json
from frontend.tool_format import ToolFormat
from frontend.tools import Tool

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _tool_lines(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in tools)


def _hermes_instructions(tools: Sequence[Tool]) -> str:
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{_tool_lines(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _llama3_instructions(tools: Sequence[Tool]) -> str:
    return ("Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables.\n\n" + "\n\n".join(json.dumps(t.as_dict(), indent=4) for t in tools))


def _mistral_instructions(tools: Sequence[Tool]) -> str:
    listing = json.dumps([t.as_dict() for t in tools], ensure_ascii=False)
    return (f"[AVAILABLE_TOOLS]{listing}[/AVAILABLE_TOOLS]\nTo call tools, answer with {MISTRAL_TAG} followed by "
            'a JSON array of {"name": ..., "arguments": {...}} objects.')


INSTRUCTIONS: dict[ToolFormat, Callable[[Sequence[Tool]], str]] = {
    ToolFormat.HERMES: _hermes_instructions, ToolFormat.LLAMA3: _llama3_instructions,
    ToolFormat.MISTRAL: _mistral_instructions}


def instructions(fmt: ToolFormat, tools: Sequence[Tool]) -> str:
    """The system-message text that offers `tools` in `fmt`'s words."""
    return INSTRUCTIONS[fmt](tools)


def _call_json(call: dict[str, Any], key: str) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    args = json.loads(args) if isinstance(args, str) and is_json(args) else (args or {})
    return json.dumps({"name": fn.get("name"), key: args}, ensure_ascii=False)


def format_calls(fmt: ToolFormat, calls: Sequence[dict[str, Any]]) -> str:
    """Earlier calls (OpenAI's `tool_calls` items) written as `fmt` spells them."""
    if fmt is ToolFormat.HERMES:
        return "\n".join(f"{HERMES_OPEN}\n{_call_json(c, 'arguments')}\n{HERMES_CLOSE}" for c in calls)
    if fmt is ToolFormat.LLAMA3:
        return "; ".join(_call_json(c, "parameters") for c in calls)
    return MISTRAL_TAG + "[" + ", ".join(_call_json(c, "arguments") for c in calls) + "]"


def tool_messages(messages: Sequence[dict[str, Any]], tools: Sequence[Tool], fmt: ToolFormat,
                  native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a conversation with tools. `native`: the template renders
    tools itself; otherwise the tools become a system message and earlier calls and results plain text."""
    if native:
        return [_native(m) for m in messages], ({"tools": [t.as_dict() for t in tools]} if tools else {})
    out = [_plain(m, fmt) for m in messages]
    if tools:
        listing = instructions(fmt, tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, {}


def _native(message: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's shape: call arguments as objects (templates `tojson` them)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str) and is_json(args):
            fn["arguments"] = json.loads(args)
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _plain(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    if message.get("tool_calls"):
        text = format_calls(fmt, message["tool_calls"])
        content = message.get("content") or ""
        return {"role": message["role"], "content": f"{content}\n{text}" if content else text}
    return {"role": message["role"], "content": message.get("content") or ""}
