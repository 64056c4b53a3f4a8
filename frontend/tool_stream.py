"""One streamed sample's text read as it grows: content as soon as it is known not to start a call, and each
call whole once its JSON closes (its opening, then its arguments). A call is never sent in part, so a stream cut
by max_tokens inside a call carries the calls that closed and nothing of the unfinished one, as the whole
response does (ToolParser.finish). The events are plain data; the HTTP server spells them as OpenAI's
deltas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

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


class ToolCallReader:
    """Feeds one sample's deltas through a parser and says what became known."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._content_sent = 0
        self._call_ids: list[str] = []  # of the calls sent

    @property
    def called(self) -> bool:
        return bool(self._call_ids)

    def feed(self, delta_text: str, finished: bool, cut: bool = False) -> list[ToolEvent]:
        """The events `delta_text` makes known. `finished`: the sample ended with it; `cut`: at max_tokens."""
        self._text += delta_text
        scan = self._parser.finish(self._text, cut) if finished else self._parser.scan(self._text, final=False)
        if finished and self._call_ids and not scan.calls:
            scan = self._parser.scan(self._text, final=False)  # calls already went out: keep them
        events: list[ToolEvent] = []
        if len(scan.content) > self._content_sent:
            events.append(ContentText(scan.content[self._content_sent:]))
            self._content_sent = len(scan.content)
        for index, call in enumerate(scan.calls[:None if self._parallel else 1]):
            if not call.complete or call.name is None:
                break
            if index == len(self._call_ids):
                self._call_ids.append(self._parser.new_call_id())
                events += [CallOpened(index, self._call_ids[index], call.name),
                           ArgumentsText(index, call.final_arguments)]
        return events
