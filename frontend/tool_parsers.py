"""Reading tool calls out of a model's text, whole or streamed, one parser per ToolFormat.

Text before the first call is the message's content; text after the calls is dropped. A call whose JSON does
not close (or has no name) leaves the whole output as content, unless the output was cut by max_tokens: then
the calls that closed before the cut are kept and the unfinished one is dropped (`finish(text, cut=True)`).
"""
from __future__ import annotations

import itertools
import secrets
import string
from typing import Any, Callable

from engine.core.outputs import ToolCall
from frontend.json_scan import PartialCall, Scan, held_back, scan_call, skip_ws, usable
from frontend.tool_format import ToolFormat, choose_format


class ToolParser:
    """One output format: scanning text (whole or streamed) for calls."""

    format = ToolFormat.HERMES
    markers: tuple[str, ...] = ()  # text that announces calls (may be special tokens of the vocabulary)
    argument_keys = ("arguments", "parameters")

    @property
    def name(self) -> str:
        return self.format.value

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def finish(self, text: str, cut: bool = False) -> Scan:
        """The scan of a finished output. `cut`: it ended at max_tokens, so a call it was writing is unfinished,
        not malformed: the complete calls before it are kept (with the content before the first call) and it is
        dropped. Without complete calls, or not cut, unusable calls leave all of the text as content."""
        scan = self.scan(text, final=True)
        if scan.calls or not cut:
            return scan
        partial = self.scan(text, final=False)
        complete = list(itertools.takewhile(lambda c: c.complete and c.name is not None, partial.calls))
        return Scan(partial.content, complete) if complete else scan

    def parse(self, text: str, new_id: Callable[[], str] | None = None, parallel: bool = True,
              cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a finished output, read as finish(text, cut) reads it."""
        scan = self.finish(text, cut)
        new_id = new_id or self.new_call_id
        calls = [ToolCall(new_id(), c.name, c.final_arguments) for c in scan.calls]
        calls = calls[:1] if not parallel else calls
        return (scan.content or None), calls

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)


class HermesParser(ToolParser):
    format = ToolFormat.HERMES
    markers = ("<tool_call>",)
    OPEN = "<tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            return Scan(text if final else text[:len(text) - held_back(text, self.OPEN)])
        calls: list[PartialCall] = []
        pos = start
        while pos >= 0:
            j = skip_ws(text, pos + len(self.OPEN))
            if j >= len(text):
                break
            call = scan_call(text, j, self.argument_keys) if text[j] == "{" else None
            if call is None:
                calls.append(PartialCall())  # not a call: unusable
                break
            calls.append(call)
            if not call.complete:
                break
            pos = text.find(self.OPEN, call.end)
        if final and not usable(calls):
            return Scan(text)
        return Scan(text[:start], [c for c in calls if c.name is not None or not final])


class Llama3Parser(ToolParser):
    format = ToolFormat.LLAMA3
    markers = ("<|python_tag|>",)
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        j = skip_ws(text, 0)
        if text.startswith(self.TAG, j):
            j = skip_ws(text, j + len(self.TAG))
        elif not final and self.TAG.startswith(text[j:]):
            return Scan("")  # nothing yet, or what may be the tag
        if j >= len(text):
            return Scan(text if final else "")
        if text[j] != "{":
            return Scan(text)
        calls = self._calls(text, j)
        if calls is None or (final and not usable(calls)):
            return Scan(text)
        return Scan("", [c for c in calls if c.name is not None or not final])

    def _calls(self, text: str, j: int) -> list[PartialCall] | None:
        """The `;`-separated call objects from text[j]; None when one is no call (the text is content)."""
        calls = []
        while j < len(text):
            call = scan_call(text, j, self.argument_keys)
            if call is None:
                return None
            calls.append(call)
            if not call.complete:
                break
            if call.name is None:
                return None  # a JSON object that is no call: content
            j = skip_ws(text, call.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            elif j < len(text):
                break
        return calls


class MistralParser(ToolParser):
    format = ToolFormat.MISTRAL
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    ID_CHARS = string.ascii_letters + string.digits

    def new_call_id(self) -> str:
        return "".join(secrets.choice(self.ID_CHARS) for _ in range(9))  # Mistral's templates require 9

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.TAG)
        if start < 0:
            return Scan(text if final else text[:len(text) - held_back(text, self.TAG)])
        calls: list[PartialCall] = []
        j = skip_ws(text, start + len(self.TAG))
        valid = j >= len(text) or text[j] == "["
        j = skip_ws(text, j + 1)
        while valid and j < len(text) and text[j] != "]":
            call = scan_call(text, j, self.argument_keys) if text[j] == "{" else None
            if call is None:
                valid = False
                break
            calls.append(call)
            if not call.complete:
                break
            j = skip_ws(text, call.end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
        if final and not (valid and usable(calls)):
            return Scan(text)
        return Scan(text[:start], [c for c in calls if c.name is not None])


PARSERS: dict[ToolFormat, type[ToolParser]] = {ToolFormat.HERMES: HermesParser, ToolFormat.LLAMA3: Llama3Parser,
                                               ToolFormat.MISTRAL: MistralParser}


def parser_for(name: str, chat_template: str | None, architecture: str | None) -> ToolParser:
    """The parser of choose_format(name, chat_template, architecture)."""
    return PARSERS[choose_format(name, chat_template, architecture)]()


def marks_special_tokens(parser: ToolParser, tokenizer: Any) -> bool:
    """Whether one of the parser's markers is a special token of `tokenizer`: the text must then keep special
    tokens for the parser to see it."""
    special = set(tokenizer.all_special_ids)
    for marker in parser.markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            return True
    return False
