"""Reading a chat's output: the reasoning split off first (for models that think), then the answer read for
tool calls. Whole (the last output of LLM.chat / AsyncLLM.chat, an HTTP response: `read_reply`) or streamed
(`ReplyStream`), with the same result."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

from engine.core.outputs import RequestOutput, ToolCall
from frontend.reasoning import ReasoningParser, ReasoningStream, Start, split_reasoning
from frontend.tool_parsers import ToolParser
from frontend.tool_stream import ContentText, ToolCallReader, ToolEvent


@dataclass(frozen=True)
class ToolCallOutput:
    """A chat whose output is read for tool calls: the format, and whether several calls may be kept."""

    parser: ToolParser
    parallel: bool = True

    def read(self, text: str, finish_reason: str | None = None) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a finished sample's text. A sample cut by max_tokens (finish_reason
        "length") keeps the calls that closed and drops the one it was writing."""
        return self.parser.parse(text, parallel=self.parallel, cut=finish_reason == "length")

    def read_output(self, out: RequestOutput) -> RequestOutput:
        """`out` with each sample's `tool_calls` and `content` read out of its text."""
        for sample in out.outputs:
            sample.content, sample.tool_calls = self.read(sample.text, sample.finish_reason)
        return out

    def reader(self, whole_calls: bool = False) -> ToolCallReader:
        """A reader of one streamed sample; `whole_calls`: each call sent once its JSON closes, never in part."""
        return ToolCallReader(self.parser, self.parallel, whole_calls)


@dataclass(frozen=True)
class ReasoningOutput:
    """A chat whose output is read for reasoning: the parser, and where its output starts (from its prompt)."""

    parser: ReasoningParser
    start: Start

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, answer) of a finished sample's text."""
        return split_reasoning(text, self.parser, self.start)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.start)


def thinking_tokens(token_ids: Sequence[int], text: str, reasoning: ReasoningOutput | None,
                    decode: Callable[[list[int]], str]) -> int:
    """How many of a finished sample's tokens are its thinking: those up to and including the one that writes
    the close tag (found by decoding prefixes, `decode` keeping special tokens), all of them when the block
    never closed, 0 when the sample did not think."""
    if reasoning is None or reasoning.split(text)[0] is None:
        return 0
    close = reasoning.parser.close
    if close not in text:
        return len(token_ids)
    low, high = 1, len(token_ids)  # the shortest prefix whose text holds the close tag
    while low < high:
        middle = (low + high) // 2
        if close in decode(list(token_ids[:middle])):
            high = middle
        else:
            low = middle + 1
    return low


@dataclass(frozen=True)
class ChatReply:
    """What a finished sample said: its reasoning (None: it did not think, or no reasoning parser), its content
    and its tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def read_reply(text: str, finish_reason: str | None, tools: ToolCallOutput | None,
               reasoning: ReasoningOutput | None) -> ChatReply:
    """A finished sample's text read: the reasoning split off, the answer read for calls. Without either
    reader the content is the text as it is."""
    thought, answer = (None, text) if reasoning is None else reasoning.split(text)
    if tools is not None:
        content, calls = tools.read(answer, finish_reason)
        return ChatReply(thought, content, calls)
    return ChatReply(thought, answer if reasoning is None else (answer or None), [])


def read_chat_output(out: RequestOutput, tools: ToolCallOutput | None,
                     reasoning: ReasoningOutput | None) -> RequestOutput:
    """`out` with each sample's `reasoning_content`, `content` and `tool_calls` (None without tools) read out of
    its text; `out` as it is when neither reader applies."""
    if tools is None and reasoning is None:
        return out
    for sample in out.outputs:
        reply = read_reply(sample.text, sample.finish_reason, tools, reasoning)
        sample.reasoning_content, sample.content = reply.reasoning, reply.content
        sample.tool_calls = reply.tool_calls if tools is not None else None
    return out


@dataclass(frozen=True)
class ReasoningText:
    text: str


ReplyEvent = Union[ReasoningText, ToolEvent]


class ReplyStream:
    """One streamed sample read as read_reply reads it whole: reasoning text, then content and tool calls. Every
    route's stream reads its samples through one (chat, Responses, Messages). `whole_calls` (chat's): each call
    sent whole once its JSON closes, so a stream cut inside a call drops it, as read_reply does; else a call's
    arguments stream as they come (Responses and Messages, whose events carry partial JSON)."""

    def __init__(self, tools: ToolCallOutput | None, reasoning: ReasoningOutput | None,
                 whole_calls: bool = True) -> None:
        self._tools = None if tools is None else tools.reader(whole_calls=whole_calls)
        self._reasoning = None if reasoning is None else reasoning.stream()

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, delta_text: str, finished: bool, cut: bool = False) -> list[ReplyEvent]:
        """The events `delta_text` makes known. `finished`: the sample ended with it; `cut`: at max_tokens."""
        events: list[ReplyEvent] = []
        if self._reasoning is not None:
            thought, delta_text = self._reasoning.feed(delta_text, finished)
            if thought:
                events.append(ReasoningText(thought))
        if self._tools is not None:
            return events + self._tools.feed(delta_text, finished, cut)
        return events + ([ContentText(delta_text)] if delta_text else [])
