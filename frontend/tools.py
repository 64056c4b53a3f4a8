"""The tools a request offers and its tool_choice, as OpenAI spells them, validated."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ToolError(ValueError):
    """Malformed tools or tool_choice; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: str  # the JSON schema of the arguments, as JSON text
    spec: str  # the whole OpenAI tool object, as JSON text (what templates are given)

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)

    def as_dict(self) -> dict[str, Any]:
        return json.loads(self.spec)


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto | none | required | named
    name: str | None = None  # for mode named

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def parse_tools(value: Any, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's `tools`: a list of `{"type": "function", "function": {"name", "description"?, "parameters"?}}`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError(param, f"'{param}' must be an array of tools.")
    tools, seen = [], set()
    for i, item in enumerate(value):
        tool = _tool(item, f"{param}[{i}]", param)
        if tool.name in seen:
            raise ToolError(param, f"'{param}' names the function {tool.name!r} twice.")
        seen.add(tool.name)
        tools.append(tool)
    return tuple(tools)


def _tool(item: Any, where: str, param: str) -> Tool:
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise ToolError(param, f"'{where}' must be an object with type 'function'.")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise ToolError(param, f"'{where}.function' must be an object.")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ToolError(param, f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-', "
                               f"got {name!r}.")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ToolError(param, f"'{where}.function.description' must be a string.")
    schema = fn.get("parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ToolError(param, f"'{where}.function.parameters' must be a JSON schema object.")
    spec = {"type": "function", "function": {**fn, "parameters": schema}}
    return Tool(name, json.dumps(schema, separators=(",", ":")), json.dumps(spec, ensure_ascii=False))


def parse_tool_choice(value: Any, tools: Sequence[Tool], param: str = "tool_choice") -> ToolChoice:
    """`auto` (the default with tools), `none` (the default without), `required`, or
    `{"type": "function", "function": {"name": ...}}`."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ToolError(param, f"'{param}' must be auto, none, required or a named function, got {value!r}.")
        if value == "required" and not tools:
            raise ToolError(param, f"'{param}' is required but the request offers no 'tools'.")
        return ToolChoice(value)
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(param, f"'{param}' must be auto, none, required or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.")
    if name not in {t.name for t in tools}:
        offered = ", ".join(t.name for t in tools) or "none"
        raise ToolError(param, f"'{param}' names the function {name!r}, which is not in 'tools' (offered: "
                               f"{offered}).")
    return ToolChoice("named", name)
