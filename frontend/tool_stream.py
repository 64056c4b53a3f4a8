"""One streamed sample's text read as it grows: content as soon as it is known not to start a call, then each
call: by default its opening once its name is known and fragments of its arguments as they come; with
`whole_calls`, each call whole once its JSON closes (its opening, then its arguments). A whole-call stream cut by
max_tokens inside a call carries the calls that closed and nothing of the unfinished one, as the whole response
does (ToolParser.finish); an incremental one has sent part of it already. The events are plain data; the HTTP
server spells them as OpenAI's deltas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from frontend.json_scan import PartialCall
from frontend.tool_parsers import ToolParser


@dataclass(frozen=True)
class ContentText:
    text: str


@dataclass(frozen=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsText:
    index: int
    text: str


ToolEvent = Union[ContentText, CallOpened, ArgumentsText]


@dataclass
class _SentCall:
    id: str
    arguments: int = 0  # argument characters sent


class ToolCallReader:
    """Feeds one sample's deltas through a parser and says what became known."""

    def __init__(self, parser: ToolParser, parallel: bool = True, whole_calls: bool = False) -> None:
        self._parser = parser
        self._parallel = parallel
        self._whole_calls = whole_calls
        self._text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def feed(self, delta_text: str, finished: bool, cut: bool = False) -> list[ToolEvent]:
        """The events `delta_text` makes known. `finished`: the sample ended with it; `cut`: at max_tokens."""
        self._text += delta_text
        scan = self._parser.finish(self._text, cut) if finished else self._parser.scan(self._text, final=False)
        if finished and self._calls and not scan.calls:
            scan = self._parser.scan(self._text, final=False)  # calls already went out: keep them
        events: list[ToolEvent] = []
        if len(scan.content) > self._content_sent:
            events.append(ContentText(scan.content[self._content_sent:]))
            self._content_sent = len(scan.content)
        for index, call in enumerate(scan.calls[:None if self._parallel else 1]):
            if call.name is None or (self._whole_calls and not call.complete):
                break
            events.extend(self._call_events(index, call))
        return events

    def _call_events(self, index: int, call: PartialCall) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if index == len(self._calls):
            self._calls.append(_SentCall(self._parser.new_call_id()))
            events.append(CallOpened(index, self._calls[index].id, call.name))
        arguments = call.final_arguments if call.complete else call.arguments
        sent = self._calls[index].arguments
        if len(arguments) > sent and arguments.startswith(call.arguments[:sent]):
            events.append(ArgumentsText(index, arguments[sent:]))
            self._calls[index].arguments = len(arguments)
        return events
