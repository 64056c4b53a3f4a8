"""OpenAI's Responses shapes translated to and from the chat shapes the rest of the front door takes.

A Responses request's `input` is text or a list of items: messages (text parts only), the model's earlier
`function_call`s and the caller's `function_call_output`s, and reasoning items handed back from an earlier
response. `input_items` checks and normalises them (so that a stored conversation holds clean items), and
`chat_messages` turns items into chat messages (Hugging Face's shape, what chat templates take): consecutive
calls join one assistant message's `tool_calls`, an output becomes a `tool` message. The Responses spellings of
`tools`, `tool_choice` and `text.format` become their chat spellings here too, so that tools, constraints and
templates are handled once, by the chat path. The items a response returns (`message_item`,
`function_call_item`, `reasoning_item`) are built here as well, since they are the same items a later request
sends back.

Errors are ItemError (a ValueError) naming the request field, e.g. `input[2].content[0]`.
"""
from __future__ import annotations

import json
from typing import Any

Item = dict[str, Any]
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text's key


class ItemError(ValueError):
    """A malformed item, tool or format; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _string(item: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ItemError(f"{where}.{key}", f"'{where}.{key}' must be a string, got {_kind(value)}.")
    return value


# ---------------------------------------------------------------------------------------- input items

def input_items(value: Any, param: str = "input") -> list[Item]:
    """`input` as a list of normalised items: a text is one user message."""
    if isinstance(value, str):
        if not value:
            raise ItemError(param, f"'{param}' must not be empty.")
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise ItemError(param, f"'{param}' must be a string or an array of items, got {_kind(value)}.")
    return [_item(item, f"{param}[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> Item:
    if not isinstance(item, dict):
        raise ItemError(where, f"'{where}' must be an object (a message, function_call or function_call_output "
                               f"item), got {_kind(item)}.")
    kind = item.get("type", "message")  # an "easy" message leaves its type out
    readers = {"message": _message, "function_call": _function_call, "function_call_output": _call_output,
               "reasoning": _reasoning}
    if kind not in readers:
        raise ItemError(f"{where}.type", f"'{where}.type' is {kind!r}; this server takes message, function_call, "
                                         f"function_call_output and reasoning items.")
    return readers[kind](item, where)


def _message(item: dict[str, Any], where: str) -> Item:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ItemError(f"{where}.role", f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}.")
    content = item.get("content")
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return {"type": "message", "role": role, "content": [{"type": part_type, "text": content}]}
    if not isinstance(content, list):
        raise ItemError(f"{where}.content", f"'{where}.content' must be a string or an array of text parts, got "
                                            f"{_kind(content)}.")
    return {"type": "message", "role": role,
            "content": [_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}


def _text_part(part: Any, where: str) -> Item:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        raise ItemError(where, f"'{where}' must be an input_text, output_text or refusal part; this server reads "
                               f"text only, got {kind!r}.")
    key = TEXT_PARTS[kind]
    return {"type": kind, key: _string(part, key, where)}


def _function_call(item: dict[str, Any], where: str) -> Item:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = _string(item, "arguments", where)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ItemError(f"{where}.arguments", f"'{where}.arguments' must be a JSON object as a string.")
    out = {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
    item_id = _string(item, "id", where, required=False)
    return out if item_id is None else out | {"id": item_id}


def _call_output(item: dict[str, Any], where: str) -> Item:
    call_id = _string(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_text_part(p, f"{where}.output[{j}]").get("text", "") for j, p in enumerate(output))
    if not isinstance(output, str):
        raise ItemError(f"{where}.output", f"'{where}.output' must be a string or an array of text parts, got "
                                           f"{_kind(output)}.")
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _reasoning(item: dict[str, Any], where: str) -> Item:
    """A reasoning item handed back from an earlier response, kept as given (its text parts checked)."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise ItemError(f"{where}.content", f"'{where}.content' must be an array of reasoning_text parts.")
    return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": p["text"]} for p in parts],
            "summary": []}


# ---------------------------------------------------------------------------------------- items -> chat

def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Normalised items as chat messages. Reasoning items are left out of the prompt: the chat templates of
    models that think drop earlier turns' thinking, and this is where a template that keeps it would get it."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool message answering it
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _joined_text(item["content"])})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            _append_call(messages, item)
        elif kind == "function_call_output":
            tool = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            messages.append(tool | ({"name": names[item["call_id"]]} if item["call_id"] in names else {}))
    return messages


def _joined_text(parts: list[Item]) -> str:
    return "".join(p.get("text", p.get("refusal", "")) for p in parts)


def _append_call(messages: list[dict[str, Any]], item: Item) -> None:
    """The call joins the assistant message just before it (its text, or the calls before it), else opens one."""
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


# ---------------------------------------------------------------------------------------- tools and format

def chat_tools(value: Any, param: str = "tools") -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "description"?, "parameters"?, "strict"?}`) as
    chat tools; any other tool type is an ItemError naming it."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ItemError(param, f"'{param}' must be an array of tools, got {_kind(value)}.")
    return [_chat_tool(tool, f"{param}[{i}]", param) for i, tool in enumerate(value)]


def _chat_tool(tool: Any, where: str, param: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ItemError(param, f"'{where}' is a {kind!r} tool; this server runs function tools only (its "
                               f"built-in tools, such as web_search or file_search, are not offered).")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(value: Any, param: str = "tool_choice") -> Any:
    """auto, none, required, or `{"type": "function", "name"}` in chat's spelling; other forced tool types are an
    ItemError."""
    if value is None or isinstance(value, str):
        return value  # the chat parser checks the word
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise ItemError(param, f"'{param}' must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}; "
                           f"this server runs function tools only, got {json.dumps(value)[:80]}.")


def chat_response_format(text: Any, param: str = "text") -> dict[str, Any] | None:
    """`text.format` (text, json_object, or json_schema with `name`, `schema`, `strict`) as chat's
    response_format; None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ItemError(param, f"'{param}' must be an object, got {_kind(text)}.")
    fmt = text.get("format")
    if fmt is None:
        return None
    where = f"{param}.format"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise ItemError(where, f"'{where}.type' must be text, json_object or json_schema, got {kind!r}.")
    if not isinstance(fmt.get("schema"), dict):
        raise ItemError(where, f"'{where}.schema' must be a JSON schema object for type json_schema.")
    spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": spec}


# ---------------------------------------------------------------------------------------- output items

def message_item(item_id: str, text: str, status: str) -> Item:
    """The assistant's text as an output message with one output_text part."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> Item:
    """A model's thinking as a reasoning item (its text as one reasoning_text part, no summary)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}
