"""A response's output items as they grow, and the typed events of its stream, in OpenAI's order.

`OutputBuilder` is fed text, calls and their arguments (whole, for a response returned at once, or delta by
delta, for a stream) and keeps the output items; each step returns the events that tell of it, each with the
next `sequence_number`:

    response.created, response.in_progress
    per item: response.output_item.added
      message:       response.content_part.added, response.output_text.delta*, response.output_text.done,
                     response.content_part.done
      function_call: response.function_call_arguments.delta*, response.function_call_arguments.done
      reasoning:     response.content_part.added, response.reasoning_text.delta*, response.reasoning_text.done,
                     response.content_part.done
    response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it; response.failed after an error)

An item is closed when the next one opens or the response finishes. Reasoning items are where a reasoning
parser's thinking goes, before the message it leads to.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.core.outputs import RequestOutput
from frontend.output import ReasoningOutput, ReasoningText, ReplyStream, ToolCallOutput, read_reply
from frontend.responses_items import (Item, function_call_item, message_item, output_text_part, reasoning_item)
from frontend.tool_stream import ArgumentsText, CallOpened, ContentText

Event = dict[str, Any]
ITEM_PREFIXES = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class _OpenItem:
    kind: str  # message, function_call or reasoning
    id: str
    index: int  # output_index
    text: str = ""  # the message's or reasoning's text, or the call's arguments
    call_id: str = ""
    name: str = ""

    def item(self, status: str, whole: bool = True) -> Item:
        """The item as it stands; `whole` False: as announced on opening (no content parts yet)."""
        if self.kind == "function_call":
            return function_call_item(self.id, self.call_id, self.name, self.text if whole else "", status)
        build = message_item if self.kind == "message" else reasoning_item
        item = build(self.id, self.text, status)
        return item if whole else item | {"content": []}

    def part(self) -> Item:
        if self.kind == "message":
            return output_text_part(self.text)
        return {"type": "reasoning_text", "text": self.text}


@dataclass
class OutputBuilder:
    """One response's output items and stream events."""

    new_id: Callable[[str], str] = new_id
    items: list[Item] = field(default_factory=list)  # the closed items, in output order
    _open: _OpenItem | None = field(default=None, init=False)
    _sequence: int = field(default=0, init=False)

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    @property
    def output(self) -> list[Item]:
        """Every item so far, the open one as it stands."""
        return self.items + ([self._open.item("in_progress")] if self._open is not None else [])

    def text(self, delta: str) -> list[Event]:
        return self._grow("message", delta, "response.output_text.delta")

    def reasoning(self, delta: str) -> list[Event]:
        return self._grow("reasoning", delta, "response.reasoning_text.delta")

    def call(self, call_id: str, name: str) -> list[Event]:
        """A function call opens (its arguments follow)."""
        events = self.close("completed")
        self._open = _OpenItem("function_call", self.new_id(ITEM_PREFIXES["function_call"]), len(self.items),
                               call_id=call_id, name=name)
        return events + [self.event("response.output_item.added", output_index=self._open.index,
                                    item=self._open.item("in_progress", whole=False))]

    def arguments(self, delta: str) -> list[Event]:
        """More of the open call's arguments."""
        if self._open is None or self._open.kind != "function_call" or not delta:
            return []
        self._open.text += delta
        return [self.event("response.function_call_arguments.delta", item_id=self._open.id,
                           output_index=self._open.index, delta=delta)]

    def _grow(self, kind: str, delta: str, delta_type: str) -> list[Event]:
        if not delta:
            return []
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        self._open.text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(delta_type, item_id=self._open.id, output_index=self._open.index,
                                    content_index=0, delta=delta, **extra)]

    def _start(self, kind: str) -> list[Event]:
        events = self.close("completed")
        self._open = opened = _OpenItem(kind, self.new_id(ITEM_PREFIXES[kind]), len(self.items))
        return events + [
            self.event("response.output_item.added", output_index=opened.index, item=opened.item("in_progress", False)),
            self.event("response.content_part.added", item_id=opened.id, output_index=opened.index, content_index=0,
                       part=opened.part())]

    def close(self, status: str) -> list[Event]:
        """Closes the open item, if any, with `status` (completed, or incomplete when the output was cut)."""
        opened, self._open = self._open, None
        if opened is None:
            return []
        where = {"item_id": opened.id, "output_index": opened.index}
        if opened.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **where, name=opened.name,
                                 arguments=opened.text)]
        else:
            done = "response.output_text.done" if opened.kind == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if opened.kind == "message" else {}
            events = [self.event(done, **where, content_index=0, text=opened.text, **extra),
                      self.event("response.content_part.done", **where, content_index=0, part=opened.part())]
        item = opened.item(status)
        self.items.append(item)
        return events + [self.event("response.output_item.done", output_index=opened.index, item=item)]

    def finish(self, status: str) -> list[Event]:
        """Closes the last item; a response that said nothing still holds one (empty) message."""
        if self._open is None and not self.items:
            return self._start("message") + self.close(status)
        return self.close(status)


class OutputFeed:
    """Feeds one engine request's outputs (its first sample) into an OutputBuilder through the chat route's
    reply reader: the thinking as a reasoning item, then the text and the calls."""

    def __init__(self, builder: OutputBuilder, tools: ToolCallOutput | None,
                 reasoning: ReasoningOutput | None = None) -> None:
        self._builder = builder
        self._reply = ReplyStream(tools, reasoning, whole_calls=False)

    def feed(self, out: RequestOutput) -> list[Event]:
        sample = out.outputs[0]
        events: list[Event] = []
        for step in self._reply.feed(sample.delta_text, sample.finished):
            if isinstance(step, ReasoningText):
                events += self._builder.reasoning(step.text)
            elif isinstance(step, ContentText):
                events += self._builder.text(step.text)
            elif isinstance(step, CallOpened):
                events += self._builder.call(step.id, step.name)
            elif isinstance(step, ArgumentsText):
                events += self._builder.arguments(step.text)
        return events


def whole_output(builder: OutputBuilder, text: str, tools: ToolCallOutput | None, status: str,
                 reasoning: ReasoningOutput | None = None) -> list[Item]:
    """A finished sample's items, read as the chat route reads it: the thinking as a reasoning item, then the
    text and the calls; one cut by max_output_tokens (status incomplete) keeps the calls that closed and drops
    the one it was writing."""
    reply = read_reply(text, "length" if status == "incomplete" else None, tools, reasoning)
    builder.reasoning(reply.reasoning or "")
    builder.text(reply.content or "")
    for call in reply.tool_calls:
        builder.call(call.id, call.name)
        builder.arguments(call.arguments)
    builder.finish(status)
    return builder.items


# ---------------------------------------------------------------------------------------- the Response object

@dataclass(frozen=True)
class ResponseHead:
    """What every snapshot of one Response object repeats: its id, time, model, and the request's settings as
    the Response object echoes them (instructions, tools, tool_choice, text, temperature, ...)."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]


def response_object(head: ResponseHead, status: str, output: list[Item], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object: `status` in_progress, completed, incomplete (cut by max_output_tokens) or failed."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": head.id, "object": "response", "created_at": head.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete, "model": head.model,
            "output": output, **head.echo, "usage": usage}


def response_usage(out: RequestOutput, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Tokens in and out of the response's engine request: its prefix-cache hits as cached_tokens, no
    cache_write_tokens (the prefix cache keeps blocks by itself, never as an explicit write a client asks for),
    and the output tokens spent thinking as reasoning_tokens."""
    prompt, completion = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    details = {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": prompt, "input_tokens_details": details,
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
            "total_tokens": prompt + completion}


def final_status(out: RequestOutput) -> str:
    """completed, or incomplete when the output ran into max_output_tokens."""
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def sse(event: Event) -> bytes:
    """One event as OpenAI sends it: its type as the SSE event name, the event as data."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def encode(events: list[Event]) -> bytes:
    return b"".join(sse(e) for e in events)
