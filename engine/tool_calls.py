"""Tool calling: the tools a request offers, how they reach the prompt, and how the output becomes tool calls.

Three output formats are parsed, one parser each, chosen per model family or by `--tool-call-parser`:

- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call;
- `llama3` (Llama 3.1+ JSON tool calling): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`parser_for` picks one from the chat template's own markers, then the architecture (qwen -> hermes,
mistral -> mistral), else hermes. Text before the first call is the message's content; text after the calls
is dropped. A call whose JSON does not close (or has no name) leaves the whole output as content.

Prompts: a chat template that mentions `tools` gets them as Hugging Face passes them (`tools=` of the
template, assistant messages with `tool_calls`, `tool` messages with `tool_call_id`). A template that does
not is given a system message listing the tools in the parser's own format (Qwen2.5's wording for hermes,
Llama 3.1's for llama3, Mistral's `[AVAILABLE_TOOLS]` for mistral), appended to the first system message
if there is one; earlier assistant calls are written into their content in the parser's format, and tool
results become user messages inside `<tool_response>` tags.

`tool_choice` "required" or a named function is enforced with the grammar engine: `forced_guide` builds an
xgrammar structural tag that spells the parser's format around the JSON schema of each function's
parameters, so the arguments always satisfy the schema.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from engine.sampling.structured import Guide

PARSER_NAMES = ("hermes", "llama3", "mistral")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_WHITESPACE = 2  # between JSON tokens of forced arguments, as for response_format
_WS = " \t\r\n"


class ToolError(ValueError):
    """Malformed tools or tool_choice; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------- request side

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
        where = f"{param}[{i}]"
        if not isinstance(item, dict) or item.get("type", "function") != "function":
            raise ToolError(param, f"'{where}' must be an object with type 'function'.")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ToolError(param, f"'{where}.function' must be an object.")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolError(param, f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-', "
                                   f"got {name!r}.")
        if name in seen:
            raise ToolError(param, f"'{param}' names the function {name!r} twice.")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(param, f"'{where}.function.description' must be a string.")
        schema = fn.get("parameters")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise ToolError(param, f"'{where}.function.parameters' must be a JSON schema object.")
        spec = {"type": "function", "function": {**fn, "parameters": schema}}
        tools.append(Tool(name, json.dumps(schema, separators=(",", ":")), json.dumps(spec, ensure_ascii=False)))
    return tuple(tools)


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


# ---------------------------------------------------------------------------------------- parsed output

@dataclass
class PartialCall:
    """A call as far as the text goes: the name once its string closed, the raw argument text so far."""

    name: str | None = None
    arguments: str = ""
    has_arguments: bool = False
    complete: bool = False  # the call's object closed
    end: int = 0  # just past the object, when complete

    @property
    def final_arguments(self) -> str:
        """The arguments of a complete call as JSON text: `{}` when the call gave none; a JSON string holding
        JSON (some models quote their arguments) is unwrapped."""
        if not self.has_arguments:
            return "{}"
        text = self.arguments.strip()
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return value if isinstance(value, str) and _is_json(value) else text


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Scan:
    content: str  # the text that is surely content (a possible start of a call is held back until final)
    calls: list[PartialCall] = field(default_factory=list)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------- JSON scanning

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Just past the JSON string that opens at text[i]; None when the text ends first."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Just past the JSON value that starts at text[i]; None when the text ends first."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


def _scan_call(text: str, i: int, argument_keys: tuple[str, ...]) -> PartialCall | None:
    """The call object that opens at text[i] == "{", as far as it goes; None when it is not one (a key that
    is not a string, a name that is not a string)."""
    call = PartialCall()
    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.complete, call.end = True, j + 1
            return call
        if text[j] == ",":
            j = _skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return None
        key_end = _string_end(text, j)
        if key_end is None:
            return call
        key = json.loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j >= len(text):
            return call
        if text[j] != ":":
            return None
        j = _skip_ws(text, j + 1)
        end = _value_end(text, j)
        if key in argument_keys and j < len(text):
            call.arguments, call.has_arguments = text[j:len(text) if end is None else end], True
        if end is None:
            return call
        if key == "name":
            name = json.loads(text[j:end])
            if not isinstance(name, str):
                return None
            call.name = name
        j = _skip_ws(text, end)
    return call


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _usable(calls: list[PartialCall]) -> bool:
    return bool(calls) and all(c.complete and c.name is not None for c in calls)


# ---------------------------------------------------------------------------------------- parsers

class ToolParser:
    """One output format: scanning text (whole or streamed) for calls, the grammar that forces calls, and the
    fallback prompt for templates that do not render tools."""

    name = ""
    markers: tuple[str, ...] = ()  # text that announces calls (may be special tokens of the vocabulary)
    argument_keys = ("arguments", "parameters")

    @staticmethod
    def default() -> ToolParser:
        return HermesParser()

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def parse(self, text: str, new_id: Callable[[], str] | None = None,
              parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a finished output; unusable calls leave all of it as content."""
        scan = self.scan(text, final=True)
        new_id = new_id or self.new_call_id
        calls = [ToolCall(new_id(), c.name, c.final_arguments) for c in scan.calls]
        calls = calls[:1] if not parallel else calls
        return (scan.content or None), calls

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def tag(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        raise NotImplementedError

    def forced_guide(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> Guide:
        """The constraint for tool_choice required (one call of any tool, or several with parallel calls) or
        named (exactly one call of that function)."""
        chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
        fmt = self.tag(chosen, choice, parallel and choice.mode != "named")
        return Guide("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

    def _tags(self, tools: Sequence[Tool], begin: Callable[[str], str], end: str, separator: str,
              parallel: bool) -> dict[str, Any]:
        tags = [{"type": "tag", "begin": begin(t.name),
                 "content": {"type": "json_schema", "json_schema": t.schema, "max_whitespace_cnt": MAX_WHITESPACE},
                 "end": end} for t in tools]
        return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
                "stop_after_first": not parallel}

    def instructions(self, tools: Sequence[Tool]) -> str:
        raise NotImplementedError

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """Earlier calls (OpenAI's `tool_calls` items) written as this format spells them."""
        raise NotImplementedError


def _call_json(call: dict[str, Any], key: str) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    args = json.loads(args) if isinstance(args, str) and _is_json(args) else (args or {})
    return json.dumps({"name": fn.get("name"), key: args}, ensure_ascii=False)


def _tool_lines(tools: Sequence[Tool]) -> str:
    return "\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in tools)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            return Scan(text if final else text[:len(text) - _held_back(text, self.OPEN)])
        calls, pos = [], start
        while pos >= 0:
            j = _skip_ws(text, pos + len(self.OPEN))
            if j >= len(text):
                break
            call = _scan_call(text, j, self.argument_keys) if text[j] == "{" else None
            if call is None:
                calls.append(PartialCall())  # not a call: unusable
                break
            calls.append(call)
            if not call.complete:
                break
            pos = text.find(self.OPEN, call.end)
        if final and not _usable(calls):
            return Scan(text)
        return Scan(text[:start], [c for c in calls if c.name is not None or not final])

    def tag(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        return self._tags(tools, lambda name: f'{self.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                          f"}}\n{self.CLOSE}", "\n", parallel)

    def instructions(self, tools: Sequence[Tool]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_tool_lines(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{_call_json(c, 'arguments')}\n{self.CLOSE}" for c in calls)


class Llama3Parser(ToolParser):
    name = "llama3"
    markers = ("<|python_tag|>",)
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        j = _skip_ws(text, 0)
        if text.startswith(self.TAG, j):
            j = _skip_ws(text, j + len(self.TAG))
        elif not final and self.TAG.startswith(text[j:]):
            return Scan("")  # nothing yet, or what may be the tag
        if j >= len(text):
            return Scan(text if final else "")
        if text[j] != "{":
            return Scan(text)
        calls = []
        while j < len(text):
            call = _scan_call(text, j, self.argument_keys)
            if call is None:
                return Scan(text)
            calls.append(call)
            if not call.complete:
                break
            if call.name is None:
                return Scan(text)  # a JSON object that is no call: content
            j = _skip_ws(text, call.end)
            if j < len(text) and text[j] == ";":
                j = _skip_ws(text, j + 1)
            elif j < len(text):
                break
        if final and not _usable(calls):
            return Scan(text)
        return Scan("", [c for c in calls if c.name is not None or not final])

    def tag(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        return self._tags(tools, lambda name: f'{{"name": {json.dumps(name)}, "parameters": ', "}", "; ",
                          parallel)

    def instructions(self, tools: Sequence[Tool]) -> str:
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                "value}. Do not use variables.\n\n" + "\n\n".join(json.dumps(t.as_dict(), indent=4) for t in tools))

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "; ".join(_call_json(c, "parameters") for c in calls)


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    ID_CHARS = string.ascii_letters + string.digits

    def new_call_id(self) -> str:
        return "".join(secrets.choice(self.ID_CHARS) for _ in range(9))  # Mistral's templates require 9

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG)
        if start < 0:
            return Scan(text if final else text[:len(text) - _held_back(text, self.TAG)])
        calls: list[PartialCall] = []
        j = _skip_ws(text, start + len(self.TAG))
        valid = j >= len(text) or text[j] == "["
        j = _skip_ws(text, j + 1)
        while valid and j < len(text) and text[j] != "]":
            call = _scan_call(text, j, self.argument_keys) if text[j] == "{" else None
            if call is None:
                valid = False
                break
            calls.append(call)
            if not call.complete:
                break
            j = _skip_ws(text, call.end)
            if j < len(text) and text[j] == ",":
                j = _skip_ws(text, j + 1)
        if final and not (valid and _usable(calls)):
            return Scan(text)
        return Scan(text[:start], [c for c in calls if c.name is not None])

    def tag(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> dict[str, Any]:
        calls = self._tags(tools, lambda name: f'{{"name": {json.dumps(name)}, "arguments": ', "}", ", ", parallel)
        return {"type": "sequence", "elements": [{"type": "const_string", "value": self.TAG + "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}

    def instructions(self, tools: Sequence[Tool]) -> str:
        listing = json.dumps([t.as_dict() for t in tools], ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{listing}[/AVAILABLE_TOOLS]\nTo call tools, answer with {self.TAG} followed by "
                'a JSON array of {"name": ..., "arguments": {...}} objects.')

    def format_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return self.TAG + "[" + ", ".join(_call_json(c, "arguments") for c in calls) + "]"


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3": Llama3Parser, "mistral": MistralParser}


def parser_for(name: str, chat_template: str | None, architecture: str | None) -> ToolParser:
    """`name` (one of PARSER_NAMES), or for "auto" the format the chat template spells, else the
    architecture's usual one, else hermes."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown tool-call parser {name!r}; expected auto or one of {', '.join(PARSER_NAMES)}")
        return PARSERS[name]()
    template = chat_template or ""
    for marker, parser in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3")):
        if marker in template:
            return PARSERS[parser]()
    arch = (architecture or "").lower()
    if "mistral" in arch:
        return MistralParser()
    return HermesParser()


# ---------------------------------------------------------------------------------------- prompts

def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tool_messages(messages: Sequence[dict[str, Any]], tools: Sequence[Tool], parser: ToolParser,
                  native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for a conversation with tools. `native`: the template renders
    tools itself; otherwise the tools become a system message and earlier calls and results plain text."""
    if native:
        return [_native(m) for m in messages], ({"tools": [t.as_dict() for t in tools]} if tools else {})
    out = [_plain(m, parser) for m in messages]
    if tools:
        listing = parser.instructions(tools)
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
        if isinstance(args, str) and _is_json(args):
            fn["arguments"] = json.loads(args)
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


def _plain(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    if message.get("tool_calls"):
        text = parser.format_calls(message["tool_calls"])
        content = message.get("content") or ""
        return {"role": message["role"], "content": f"{content}\n{text}" if content else text}
    return {"role": message["role"], "content": message.get("content") or ""}


def marks_special_tokens(parser: ToolParser, tokenizer: Any) -> bool:
    """Whether one of the parser's markers is a special token of `tokenizer`: the text must then keep special
    tokens for the parser to see it."""
    special = set(tokenizer.all_special_ids)
    for marker in parser.markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            return True
    return False


# ---------------------------------------------------------------------------------------- streaming

class ToolCallStream:
    """One streamed sample's text -> OpenAI `delta`s: content as it is known not to start a call; a call's
    first delta with its id, type and name, then fragments of its arguments."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._content_sent = 0
        self._calls: list[list[Any]] = []  # [id, argument characters sent]

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def feed(self, delta_text: str, finished: bool) -> list[dict[str, Any]]:
        self._text += delta_text
        scan = self._parser.scan(self._text, final=finished)
        if finished and self._calls and not scan.calls:
            scan = self._parser.scan(self._text, final=False)  # calls already went out: keep them
        deltas = []
        if len(scan.content) > self._content_sent:
            deltas.append({"content": scan.content[self._content_sent:]})
            self._content_sent = len(scan.content)
        for index, call in enumerate(scan.calls[:None if self._parallel else 1]):
            if call.name is None:
                break
            if index == len(self._calls):
                self._calls.append([self._parser.new_call_id(), 0])
                deltas.append({"tool_calls": [{"index": index, "id": self._calls[index][0], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            arguments = call.final_arguments if call.complete else call.arguments
            sent = self._calls[index][1]
            if len(arguments) > sent and arguments.startswith(self._sent_arguments(call, sent)):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[sent:]}}]})
                self._calls[index][1] = len(arguments)
        return deltas

    @staticmethod
    def _sent_arguments(call: PartialCall, sent: int) -> str:
        return call.arguments[:sent]
