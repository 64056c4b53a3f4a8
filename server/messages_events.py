"""Anthropic's Messages reply, whole or as its event sequence, built from the engine's outputs.

A stream is `message_start`, then per content block `content_block_start`, its `content_block_delta`s
(`thinking_delta` then one `signature_delta` for thinking, `text_delta` for text, `input_json_delta` for a
tool_use's input) and `content_block_stop`, then `message_delta` (stop_reason, stop_sequence and the usage)
and `message_stop`. One block is open at a time: the thinking (for a model that thinks), text, then each tool
call, in the order the chat route's reply reader (frontend.output.ReplyStream) finds them. Usage follows
Anthropic's meaning: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens` those whose KV came
from the prefix cache (the prompt is their sum).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.core.outputs import CompletionOutput, RequestOutput, ToolCall
from frontend.anthropic_thinking import thinking_block
from frontend.output import ReasoningOutput, ReasoningText, ReplyEvent, ReplyStream, ToolCallOutput, read_reply
from frontend.tool_stream import ArgumentsText, CallOpened, ContentText

Json = dict[str, Any]
Event = tuple[str, Json]  # (the SSE event name, its data)


@dataclass(frozen=True)
class MessageMeta:
    id: str  # msg_...
    model: str


def message_id(request_id: str) -> str:
    """The reply's id: the request id's random part after Anthropic's `msg_` prefix."""
    return "msg_" + request_id.rpartition("-")[2]


def message_usage(out: RequestOutput, output_tokens: int | None = None) -> Json:
    cached = out.num_cached_tokens
    produced = len(out.outputs[0].token_ids) if output_tokens is None else output_tokens
    return {"input_tokens": len(out.prompt_token_ids) - cached, "output_tokens": produced,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def stop_reason(sample: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished sample: tool_use when it ended after its calls, stop_sequence
    with the string that matched, max_tokens at the limit, end_turn at the model's end of turn."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.stop_reason is not None:
        return "stop_sequence", sample.stop_reason
    return ("tool_use" if called else "end_turn"), None


def message_json(meta: MessageMeta, content: list[Json], reason: tuple[str | None, str | None],
                 usage: Json) -> Json:
    return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage}


def tool_input(arguments: str) -> Any:
    """A call's arguments (JSON text) as the tool_use block's `input`; text that does not parse stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tool_use_block(call: ToolCall) -> Json:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}


def message_body(meta: MessageMeta, final: RequestOutput, tools: ToolCallOutput | None,
                 reasoning: ReasoningOutput | None = None, shown: bool = True) -> Json:
    """The whole reply: a thinking block (when the model thought; empty unless `shown`), a text block (when
    there is text), then a tool_use block per call."""
    sample = final.outputs[0]
    reply = read_reply(sample.text, sample.finish_reason, tools, reasoning)
    blocks = [thinking_block(reply.reasoning, shown)] if reply.reasoning else []
    blocks += [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [tool_use_block(c) for c in reply.tool_calls]
    return message_json(meta, blocks, stop_reason(sample, bool(reply.tool_calls)), message_usage(final))


class MessageEvents:
    """One reply's outputs as Anthropic's events, in order. The text goes through the chat route's reply
    reader: the thinking becomes a thinking block, each call a tool_use block whose input streams as
    input_json_delta. `shown` False (display: omitted): the thinking block carries no thinking_delta."""

    def __init__(self, meta: MessageMeta, tools: ToolCallOutput | None, reasoning: ReasoningOutput | None = None,
                 shown: bool = True) -> None:
        self._meta = meta
        self._reply = ReplyStream(tools, reasoning, whole_calls=False)
        self._shown = shown
        self._blocks = 0  # content blocks started
        self._open: str | None = None  # the open block's type
        self._call_block: dict[int, int] = {}  # a call's index -> its block's index
        self._arguments_started: set[int] = set()

    def opening(self, first: RequestOutput) -> list[Event]:
        message = message_json(self._meta, [], (None, None), message_usage(first, output_tokens=0))
        return [("message_start", {"type": "message_start", "message": message})]

    def events(self, out: RequestOutput) -> list[Event]:
        sample = out.outputs[0]
        pieces = self._reply.feed(sample.delta_text, sample.finished)
        return [event for piece in pieces for event in self._piece(piece)]

    def closing(self, last: RequestOutput) -> list[Event]:
        reason = stop_reason(last.outputs[0], self._reply.called)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                 "usage": message_usage(last)}
        return [*self._close(), ("message_delta", delta), ("message_stop", {"type": "message_stop"})]

    def _piece(self, piece: ReplyEvent) -> list[Event]:
        if isinstance(piece, ReasoningText):
            started = [] if self._open == "thinking" else self._start(thinking_block(""))
            shown = self._shown and piece.text
            return started + ([self._delta({"type": "thinking_delta", "thinking": piece.text})] if shown else [])
        if isinstance(piece, ContentText):
            started = [] if self._open == "text" else self._start({"type": "text", "text": ""})
            return started + [self._delta({"type": "text_delta", "text": piece.text})]
        if isinstance(piece, CallOpened):
            started = self._start({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
            self._call_block[piece.index] = self._blocks - 1
            return started
        return self._arguments(piece)

    def _arguments(self, piece: ArgumentsText) -> list[Event]:
        # A fragment of blanks alone is no JSON a client's partial parser can read: blanks before the input's
        # first character are dropped.
        text = piece.text if piece.index in self._arguments_started else piece.text.lstrip()
        if not text:
            return []
        self._arguments_started.add(piece.index)
        return [self._delta({"type": "input_json_delta", "partial_json": text}, self._call_block[piece.index])]

    def _start(self, block: Json) -> list[Event]:
        events = self._close()
        self._open = block["type"]
        self._blocks += 1
        return events + [("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                                  "content_block": block})]

    def _delta(self, delta: Json, index: int | None = None) -> Event:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": self._blocks - 1 if index is None else index, "delta": delta})

    def _close(self) -> list[Event]:
        """The open block's stop; a thinking block's signature (empty: nothing to verify here) just before it."""
        if self._open is None:
            return []
        signed = [self._delta({"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = None
        return signed + [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]


def encode_events(events: list[Event]) -> bytes:
    """Server-sent events with their names, as Anthropic's clients read them."""
    return b"".join(b"event: " + name.encode() + b"\ndata: "
                    + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                    for name, data in events)
