"""Server-sent events: successive RequestOutputs of one request -> OpenAI stream chunks -> `data:` lines."""
from __future__ import annotations

import json
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput
from engine.tokenizer import Tokenizer
from server.responses import (Json, ResponseMeta, chat_chunk, chat_delta_choice, chat_role_choice, completion_choice,
                              completion_chunk, usage_chunk)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ChunkBuilder:
    """Turns one request's outputs into chunks: a choice appears when it has new text (or new logprobs, when
    asked for), and its finish_reason is sent exactly once."""

    def __init__(self, meta: ResponseMeta, tokenizer: Tokenizer, *, chat: bool, wants_logprobs: bool,
                 include_usage: bool) -> None:
        self._meta = meta
        self._tokenizer = tokenizer
        self._chat = chat
        self._wants_logprobs = wants_logprobs
        self._include_usage = include_usage
        self._finished: set[int] = set()
        self._text_offsets: dict[int, int] = {}

    def opening(self, num_choices: int) -> list[Json]:
        """Chat streams open with the assistant role, one chunk per choice, as OpenAI's do."""
        if not self._chat:
            return []
        return [self._chunk([chat_role_choice(i)]) for i in range(num_choices)]

    def chunks(self, out: RequestOutput) -> list[Json]:
        return [self._chunk([self._choice(o)]) for o in out.outputs if self._has_news(o)]

    def closing(self, last: RequestOutput) -> list[Json]:
        if not self._include_usage:
            return []
        return [usage_chunk(self._meta, self._chat, len(last.prompt_token_ids), last.outputs)]

    def _has_news(self, o: CompletionOutput) -> bool:
        if o.index in self._finished:
            return False
        if o.finish_reason is not None:
            self._finished.add(o.index)
            return True
        return bool(o.delta_text or (self._wants_logprobs and o.delta_token_ids))

    def _choice(self, o: CompletionOutput) -> Json:
        if self._chat:
            return chat_delta_choice(self._tokenizer, o, self._wants_logprobs, o.finish_reason)
        entries = o.delta_logprobs if self._wants_logprobs else None
        choice = completion_choice(self._tokenizer, o, o.delta_text, entries, self._text_offsets.get(o.index, 0))
        if choice["logprobs"] is not None:
            self._text_offsets[o.index] = self._text_offsets.get(o.index, 0) + sum(
                len(t) for t in choice["logprobs"]["tokens"])
        return choice

    def _chunk(self, choices: list[Json]) -> Json:
        build = chat_chunk if self._chat else completion_chunk
        return build(self._meta, choices, self._include_usage)


def encode_events(payloads: list[Json]) -> bytes:
    return b"".join(sse_event(p) for p in payloads)
