"""Reading a tool call's JSON object as far as a (possibly streamed, possibly cut off) text goes.

`json.loads` needs the whole value; a streamed call must be known by its name before its arguments close,
and a call cut off by max_tokens must be told from one that closed. These helpers walk the text by hand,
string escapes and nesting included, and report how far each value goes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"


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
        return value if isinstance(value, str) and is_json(value) else text


@dataclass
class Scan:
    content: str  # the text that is surely content (a possible start of a call is held back until final)
    calls: list[PartialCall] = field(default_factory=list)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
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


def _container_end(text: str, i: int) -> int | None:
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = string_end(text, j)
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


def value_end(text: str, i: int) -> int | None:
    """Just past the JSON value that starts at text[i]; None when the text ends first."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        return _container_end(text, i)
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


def scan_call(text: str, i: int, argument_keys: tuple[str, ...]) -> PartialCall | None:
    """The call object that opens at text[i] == "{", as far as it goes; None when it is not one (a key that
    is not a string, a name that is not a string)."""
    call = PartialCall()
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            call.complete, call.end = True, j + 1
            return call
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return None
        key_end = string_end(text, j)
        if key_end is None:
            return call
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return call
        if text[j] != ":":
            return None
        j = skip_ws(text, j + 1)
        end = value_end(text, j)
        if key in argument_keys and j < len(text):
            call.arguments, call.has_arguments = text[j:len(text) if end is None else end], True
        if end is None:
            return call
        if key == "name":
            name = json.loads(text[j:end])
            if not isinstance(name, str):
                return None
            call.name = name
        j = skip_ws(text, end)
    return call


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def usable(calls: list[PartialCall]) -> bool:
    return bool(calls) and all(c.complete and c.name is not None for c in calls)
