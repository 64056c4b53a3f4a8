"""Server-sent events: successive RequestOutputs of one request -> OpenAI stream chunks -> `data:` lines."""
from __future__ import annotations

import json
from typing import Any

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.model.tokenizer import Tokenizer
from frontend.output import ReasoningOutput, ReasoningText, ReplyEvent, ReplyStream, ToolCallOutput
from frontend.tool_stream import CallOpened, ContentText
from server.prompt_logprobs import echoed
from server.responses import (Json, ResponseMeta, chat_chunk, chat_delta_choice, chat_logprobs,
                              chat_role_choice, completion_choice, completion_chunk, output_usage,
                              reasoning_usage, usage_chunk)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def tool_delta(event: ReplyEvent) -> Json:
    """A reply reader's event as OpenAI's `delta`: reasoning (vLLM's `reasoning_content`), content, a call's
    opening with its id, type and name, or its arguments."""
    if isinstance(event, ReasoningText):
        return {"reasoning_content": event.text}
    if isinstance(event, ContentText):
        return {"content": event.text}
    if isinstance(event, CallOpened):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}  # ArgumentsText


def tool_deltas(events: list[ReplyEvent]) -> list[Json]:
    return [tool_delta(e) for e in events]


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ChunkBuilder:
    """Turns one request's outputs into chunks: a choice appears when it has new text (or new logprobs, when
    asked for), and its finish_reason is sent exactly once. With tools or a model that thinks, a sample's text
    goes through a ReplyStream: reasoning, content and tool-call deltas, each in a chunk of its own. With echo,
    a completion's first chunk starts with the prompt, and with `echo_logprobs` its logprobs with the prompt's."""

    def __init__(self, meta: ResponseMeta, tokenizer: Tokenizer, *, chat: bool, wants_logprobs: bool,
                 include_usage: bool, tools: ToolCallOutput | None = None, echo: str | None = None,
                 echo_logprobs: int | None = None, reasoning: ReasoningOutput | None = None) -> None:
        self._meta = meta
        self._tokenizer = tokenizer
        self._chat = chat
        self._wants_logprobs = wants_logprobs
        self._include_usage = include_usage
        self._finished: set[int] = set()
        self._text_offsets: dict[int, int] = {}
        self._tools = tools
        self._reasoning = reasoning
        self._replies: dict[int, ReplyStream] = {}
        self._echo = echo
        self._echo_logprobs = echo_logprobs
        self._echoed: set[int] = set()

    def opening(self, num_choices: int) -> list[Json]:
        """Chat streams open with the assistant role, one chunk per choice, as OpenAI's do."""
        if not self._chat:
            return []
        return [self._chunk([chat_role_choice(i)]) for i in range(num_choices)]

    def chunks(self, out: RequestOutput) -> list[Json]:
        chunks = []
        for o in out.outputs:
            if not self._has_news(o):
                continue
            if self._chat and (self._tools is not None or self._reasoning is not None):
                chunks.extend(self._chunk([choice]) for choice in self._reply_choices(o))
            else:
                chunks.append(self._chunk([self._choice(o, out)]))
        return chunks

    def _reply_choices(self, o: CompletionOutput) -> list[Json]:
        stream = self._replies.get(o.index)
        if stream is None:
            stream = self._replies[o.index] = ReplyStream(self._tools, self._reasoning)
        deltas = tool_deltas(stream.feed(o.delta_text, o.finished, cut=o.finish_reason == "length"))
        logprobs = chat_logprobs(self._tokenizer, o.delta_logprobs) if self._wants_logprobs else None
        if not deltas and (o.finished or logprobs is not None):
            deltas = [{}]
        reason = "tool_calls" if o.finish_reason == "stop" and stream.called else o.finish_reason
        return [{"index": o.index, "delta": delta, "logprobs": logprobs if i == 0 else None,
                 "finish_reason": reason if i == len(deltas) - 1 else None} for i, delta in enumerate(deltas)]

    def closing(self, last: RequestOutput) -> list[Json]:
        if not self._include_usage:
            return []
        thought = reasoning_usage(last, self._tokenizer, self._reasoning) if self._chat else None
        return [usage_chunk(self._meta, self._chat, output_usage(last, reasoning_tokens=thought))]

    def _has_news(self, o: CompletionOutput) -> bool:
        if o.index in self._finished:
            return False
        if o.finish_reason is not None:
            self._finished.add(o.index)
            return True
        return bool(o.delta_text or (self._wants_logprobs and o.delta_token_ids))

    def _choice(self, o: CompletionOutput, out: RequestOutput) -> Json:
        if self._chat:
            return chat_delta_choice(self._tokenizer, o, self._wants_logprobs, o.finish_reason)
        entries = o.delta_logprobs if self._wants_logprobs else None
        text = o.delta_text
        first = self._echo is not None and o.index not in self._echoed
        if first:
            self._echoed.add(o.index)
            text = self._echo + text
        choice = completion_choice(self._tokenizer, o, text, entries, self._text_offsets.get(o.index, 0))
        if first and self._echo_logprobs is not None:
            choice["logprobs"] = echoed(self._tokenizer, out, choice["logprobs"], self._echo_logprobs)
        if choice["logprobs"] is not None:
            self._text_offsets[o.index] = self._text_offsets.get(o.index, 0) + sum(
                len(t) for t in choice["logprobs"]["tokens"])
        return choice

    def _chunk(self, choices: list[Json]) -> Json:
        build = chat_chunk if self._chat else completion_chunk
        return build(self._meta, choices, self._include_usage)


def encode_events(payloads: list[Json]) -> bytes:
    return b"".join(sse_event(p) for p in payloads)
