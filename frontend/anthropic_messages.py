"""Anthropic's Messages request as the chat request the chat route parses (OpenAI's chat body), so that one
preparation renders its template and tools, builds its constraints and applies its stops.

What becomes what:
- `system` (a string or text blocks) -> a system message first;
- a message's text blocks -> its content, blocks joined by a blank line; an assistant's `tool_use` blocks ->
  its `tool_calls` (`input` as the arguments' JSON); a user's `tool_result` blocks -> `tool` messages in
  place (`is_error: true` -> the result's text after "Error: "); `thinking` blocks of earlier assistant turns
  are dropped, as Anthropic drops them; consecutive messages of one role are merged, as Anthropic merges them;
- `tools` (client tools: `name`, `description`, `input_schema`) -> function tools; `tool_choice` auto / any /
  tool / none -> auto / required / the named function / none, `disable_parallel_tool_use` ->
  `parallel_tool_calls: false`; `stop_sequences` -> `stop`; `output_config.format` json_schema ->
  `response_format`; `thinking` -> the template's `enable_thinking` (frontend/anthropic_thinking.py; its
  budget_tokens is set on the parsed request); `max_tokens`, `temperature`, `top_p`, `top_k`, `stream` and
  `model` keep their names.

Every other top-level field is in MESSAGES_FIELDS with its fate: implemented, refused (a MessagesError naming
it) or ignored (it cannot change the output); the chat route's own extensions are passed on by name
(server/messages_fields.py); fields in no table are ignored, as on the other routes. Blocks
the served model cannot read (images, documents, server tools' blocks) and a last message from the assistant
(prefill: the chat template always opens a new turn) are refused. Knows nothing of HTTP.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from frontend.anthropic_thinking import Thinking, ThinkingError, parse_thinking
from frontend.tools import TOOL_NAME

Json = dict[str, Any]
BLOCK_JOIN = "\n\n"  # between the text blocks of one message, and between merged messages
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use")
DROPPED_BLOCKS = ("thinking", "redacted_thinking")  # earlier turns' thinking, which Anthropic drops too
KEPT_NAMES = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")  # the chat body's names too


class MessagesError(ValueError):
    """A Messages request this server cannot run as given; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _given(value: Any) -> bool:
    return value is not None and value != [] and value != {}


@dataclass(frozen=True)
class MessagesField:
    fate: str  # implemented, refused or ignored
    why: str
    refused_if: Callable[[Any], bool] = _given  # refused: the values refused
    example: Any = True  # refused: a value that is refused


def _impl(why: str) -> MessagesField:
    return MessagesField("implemented", why)


def _refuse(why: str, example: Any, refused_if: Callable[[Any], bool] = _given) -> MessagesField:
    return MessagesField("refused", why, refused_if, example)


def _ignore(why: str) -> MessagesField:
    return MessagesField("ignored", why)


MESSAGES_FIELDS: dict[str, MessagesField] = {
    "model": _impl("must name the served model"),
    "messages": _impl("user and assistant turns: text, tool_use and tool_result blocks"),
    "system": _impl("a string or text blocks, rendered as the system message"),
    "max_tokens": _impl("required on /v1/messages, as Anthropic requires it; capped at the room the prompt leaves"),
    "stop_sequences": _impl("stop strings; the one that matched is the reply's stop_sequence"),
    "temperature": _impl("sampling temperature; 0 is greedy"),
    "top_p": _impl("nucleus sampling"),
    "top_k": _impl("the k likeliest tokens only"),
    "stream": _impl("Anthropic's event sequence"),
    "tools": _impl("client tools with input_schema, rendered through the chat template"),
    "tool_choice": _impl("auto, any, tool (the last two grammar-enforced) or none; disable_parallel_tool_use"),
    "output_config": _impl("format json_schema constrains the reply (effort is refused)"),
    "thinking": _impl("enabled (budget_tokens enforced), adaptive or disabled: the template's enable_thinking; "
                      "the reply's thinking block (frontend/anthropic_thinking.py)"),
    "output_format": _refuse("send output_config.format instead", {"type": "json_schema", "schema": {}}),
    "container": _refuse("no code-execution containers", "container_1"),
    "mcp_servers": _refuse("no MCP servers are called", [{"type": "url", "url": "http://x", "name": "x"}]),
    "context_management": _refuse("the context is never edited", {"edits": [{"type": "clear_tool_uses"}]}),
    "metadata": _ignore("user_id is for abuse monitoring"),
    "service_tier": _ignore("one tier"),
    "cache_control": _ignore("prefix caching is automatic"),
    "inference_geo": _ignore("one place"),
    "speed": _ignore("one speed"),
    "diagnostics": _ignore("no prompt-cache diagnostics"),
    "user_profile_id": _ignore("no user profiles"),
    "workspace_id": _ignore("no workspaces"),
}


def refuse_unsupported(body: Json) -> None:
    """MessagesError naming the first field of `body` whose value this server refuses."""
    for name, field in MESSAGES_FIELDS.items():
        if field.fate == "refused" and name in body and field.refused_if(body[name]):
            raise MessagesError(name, f"'{name}' is not supported by this server: {field.why}.")


def _type_error(where: str, expected: str, value: Any) -> MessagesError:
    got = "null" if value is None else type(value).__name__
    return MessagesError(where, f"'{where}' must be {expected}, got {got}.")


# ---------------------------------------------------------------------------------------- the request

def chat_body(body: Json, count: bool = False) -> Json:
    """The OpenAI chat body that asks for what `body` asks for. `count`: a count_tokens body, which needs no
    max_tokens. MessagesError naming the field for anything malformed or refused."""
    refuse_unsupported(body)
    if not count and body.get("max_tokens") is None:
        raise MessagesError("max_tokens", "'max_tokens' is required: the most tokens the reply may hold.")
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in tools])
    _check_strict(body.get("tools"), choice)
    chat = {name: body[name] for name in KEPT_NAMES if name in body}
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    chat |= {"tools": tools} if tools else {}
    chat |= {"tool_choice": choice} if choice is not None else {}
    chat |= {} if parallel else {"parallel_tool_calls": False}
    chat |= _stop_sequences(body.get("stop_sequences"))
    chat |= _output_config(body.get("output_config"))
    kwargs = thinking_of(body).template_kwargs()
    return chat | ({"chat_template_kwargs": kwargs} if kwargs else {})


def thinking_of(body: Json) -> Thinking:
    """The request's `thinking`; MessagesError naming the field when it is malformed or unsupported."""
    try:
        return parse_thinking(body.get("thinking"))
    except ThinkingError as exc:
        raise MessagesError(exc.param, str(exc)) from None


def _stop_sequences(value: Any) -> Json:
    if value is None:
        return {}
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop_sequences", "an array of strings", value)
    return {"stop": value} if value else {}


def _output_config(value: Any) -> Json:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _type_error("output_config", "an object", value)
    if value.get("effort") is not None:
        raise MessagesError("output_config.effort", "'output_config.effort' is not supported by this server: the "
                                                    "served model has no effort setting.")
    fmt = value.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise MessagesError("output_config.format", "'output_config.format' must be {\"type\": \"json_schema\", "
                                                    "\"schema\": {...}}.")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


# ---------------------------------------------------------------------------------------- system and messages

def _system(value: Any) -> list[Json]:
    if value is None:
        return []
    text = value if isinstance(value, str) else _texts(value, "system")
    return [{"role": "system", "content": text}]


def _texts(blocks: Any, where: str) -> str:
    """Text blocks (a system prompt, a tool result's content) joined; MessagesError for any other block."""
    if not isinstance(blocks, list):
        raise _type_error(where, "a string or an array of text blocks", blocks)
    texts = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise _unreadable(kind, f"{where}[{j}].type", ("text",))
        texts.append(_text(block, f"{where}[{j}]"))
    return BLOCK_JOIN.join(t for t in texts if t)


def _messages(value: Any) -> list[Json]:
    if value is None:
        raise MessagesError("messages", "'messages' is required.")
    if not isinstance(value, list):
        raise _type_error("messages", "an array of messages", value)
    if not value:
        raise MessagesError("messages", "'messages' must hold at least one message.")
    out: list[Json] = []
    for i, item in enumerate(value):
        for message in _message(item, f"messages[{i}]"):
            _append(out, message)
    if value[-1].get("role") == "assistant":
        raise MessagesError("messages", "'messages' ends with the assistant's turn (a prefill to continue), which "
                                        "this server does not continue: the chat template always opens a new "
                                        "turn; end with a user message.")
    return out


def _append(out: list[Json], message: Json) -> None:
    """Appends `message`, merged into the last one when both are user or both assistant turns."""
    last = out[-1] if out else None
    if last is None or last["role"] != message["role"] or message["role"] == "tool":
        out.append(message)
        return
    last["content"] = BLOCK_JOIN.join(t for t in (last["content"], message["content"]) if t)
    if message.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]


def _message(item: Any, where: str) -> list[Json]:
    if not isinstance(item, dict):
        raise _type_error(where, "an object with 'role' and 'content'", item)
    role = item.get("role")
    if role not in ("user", "assistant"):
        raise MessagesError(f"{where}.role", f"'{where}.role' must be user or assistant, got {role!r}.")
    content = item.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _type_error(f"{where}.content", "a string or an array of content blocks", content)
    return _user(content, where) if role == "user" else [_assistant(content, where)]


def _user(blocks: list[Any], where: str) -> list[Json]:
    """A user turn's blocks: its text as user messages, each tool_result as a tool message, in order."""
    out: list[Json] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            out += _flush(texts) + [_tool_result(block, at)]
            texts = []
        else:
            raise _unreadable(kind, f"{at}.type", USER_BLOCKS)
    out += _flush(texts)
    return out or [{"role": "user", "content": ""}]  # a turn of empty text is still a turn


def _flush(texts: list[str]) -> list[Json]:
    joined = BLOCK_JOIN.join(t for t in texts if t)
    return [{"role": "user", "content": joined}] if joined else []


def _assistant(blocks: list[Any], where: str) -> Json:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind not in DROPPED_BLOCKS:
            raise _unreadable(kind, f"{at}.type", ASSISTANT_BLOCKS)
    message: Json = {"role": "assistant", "content": BLOCK_JOIN.join(t for t in texts if t)}
    return message | ({"tool_calls": calls} if calls else {})


# ---------------------------------------------------------------------------------------- blocks

def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _type_error(where, "a content block (an object with a 'type')", block)
    return block["type"]


def _unreadable(kind: str, where: str, allowed: tuple[str, ...]) -> MessagesError:
    if kind in ("image", "document", "search_result", "container_upload"):
        why = f"{kind} blocks are not supported: the served model reads text only"
    else:
        why = f"{kind!r} blocks are not supported here; this takes {', '.join(allowed)} blocks"
    return MessagesError(where, f"'{where}': {why}.")


def _text(block: Json, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _type_error(f"{where}.text", "a string", text)
    return text


def _string(block: Json, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value:
        raise _type_error(f"{where}.{key}", "a non-empty string", value)
    return value


def _tool_use(block: Json, where: str) -> Json:
    name, call_id = _string(block, "name", where), _string(block, "id", where)
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise _type_error(f"{where}.input", "an object", arguments)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: Json, where: str) -> Json:
    call_id = _string(block, "tool_use_id", where)
    content = block.get("content")
    text = "" if content is None else content if isinstance(content, str) else _texts(content, f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool) and is_error is not None:
        raise _type_error(f"{where}.is_error", "a boolean", is_error)
    return {"role": "tool", "tool_call_id": call_id, "content": ERROR_PREFIX + text if is_error else text}


# ---------------------------------------------------------------------------------------- tools

def _tools(value: Any) -> list[Json]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _type_error("tools", "an array of tools", value)
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]


def _tool(tool: Any, where: str) -> Json:
    if not isinstance(tool, dict):
        raise _type_error(where, "a tool object", tool)
    if tool.get("type", "custom") not in ("custom", None):
        raise MessagesError(f"{where}.type", f"'{where}.type' {tool['type']!r} is a server tool, which this server "
                                             f"does not run; give client tools (name, description, input_schema).")
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise MessagesError(f"{where}.name", f"'{where}.name' must be 1 to 64 letters, digits, '_', '.' or '-', "
                                             f"got {name!r}.")
    if not isinstance(tool.get("input_schema"), dict):
        raise _type_error(f"{where}.input_schema", "a JSON schema object", tool.get("input_schema"))
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise _type_error(f"{where}.description", "a string", tool["description"])
    _refuse_tool_extras(tool, where)
    function = {"name": name, "parameters": tool["input_schema"]}
    return {"type": "function", "function": function | ({"description": tool["description"]}
                                                        if tool.get("description") else {})}


def _refuse_tool_extras(tool: Json, where: str) -> None:
    if _given(tool.get("input_examples")):
        raise MessagesError(f"{where}.input_examples", f"'{where}.input_examples' is not supported by this server: "
                                                       "examples are not rendered into the prompt.")
    if tool.get("defer_loading"):
        raise MessagesError(f"{where}.defer_loading", f"'{where}.defer_loading' is not supported by this server: "
                                                      "there is no tool search; every tool is in the prompt.")


def _tool_choice(value: Any, names: list[str]) -> tuple[Any, bool]:
    """(the chat's tool_choice or None, whether several calls may be made)."""
    if value is None:
        return None, True
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _type_error("tool_choice", "an object with a 'type' (auto, any, tool or none)", value)
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _type_error("tool_choice.disable_parallel_tool_use", "a boolean", disable)
    kind = value["type"]
    if kind in ("any", "tool") and not names:
        raise MessagesError("tool_choice", f"'tool_choice' {kind} needs 'tools', and the request offers none.")
    if kind == "tool":
        return _named(value.get("name"), names), not disable
    choices = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in choices:
        raise MessagesError("tool_choice.type", f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}.")
    return choices[kind], not disable


def _named(name: Any, names: list[str]) -> Json:
    if not isinstance(name, str):
        raise _type_error("tool_choice.name", "the name of one of 'tools'", name)
    if name not in names:
        raise MessagesError("tool_choice.name", f"'tool_choice.name' is {name!r}, which is not in 'tools' (offered: "
                                                f"{', '.join(names)}).")
    return {"type": "function", "function": {"name": name}}


def _check_strict(tools: Any, choice: Any) -> None:
    """strict: true promises inputs that follow the schema, which holds only where a call is grammar-forced."""
    if choice == "required" or isinstance(choice, dict):
        return
    for i, tool in enumerate(tools or ()):
        if tool.get("strict"):
            raise MessagesError(f"tools[{i}].strict", f"'tools[{i}].strict' is supported only with 'tool_choice' "
                                                      "any or tool, where the grammar enforces the input_schema.")
