"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat route's preparation.

The body is translated into the chat body (frontend.anthropic_messages), parsed by the chat route's parser and
prepared by its `prepare`, so the template, tools, constraints and stops are the chat route's own; only the
reply's shape (server.messages_events) and the errors' shape are Anthropic's. Errors on these routes, the API
key's 401 and unknown sub-routes included, are `{"type": "error", "error": {"type", "message"}}` with the same
status codes as elsewhere; a failure after a stream's headers is an `error` event.
"""
from __future__ import annotations

import dataclasses
import re
import time
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web

from frontend.anthropic_messages import MessagesError, chat_body, thinking_of
from frontend.anthropic_thinking import Thinking
from frontend.front_door import ChatTools
from server.context import CONTEXT, REQUEST_ID, TRACKER, ServerContext
from server.errors import ApiError, bad_request, from_http_exception
from server.generation import (Prepared, RequestTracker, encode_prompt, engine_outputs, placement_headers, prepare,
                               read_body)
from server.messages_events import MessageEvents, MessageMeta, encode_events, message_body, message_id
from server.messages_fields import with_chat_fields
from server.protocol import GenerationRequest, parse_chat, parse_json_body
from server.streaming import SSE_HEADERS

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ROUTE = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}
# The chat body's fields that stand for a Messages field of another name, for the errors' wording.
_RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format",
            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "thinking_budget": "thinking.budget_tokens"}


class AnthropicError(ApiError):
    """An ApiError written in Anthropic's shape."""

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def anthropic_error(err: ApiError) -> AnthropicError:
    """`err` in Anthropic's shape, a chat field that stands for a Messages field named as the latter."""
    param, message = err.param, err.message
    for chat_name, name in _RENAMED.items():
        if param == chat_name:
            param = name
        message = re.sub(rf"'{re.escape(chat_name)}'", f"'{name}'", message)
    return AnthropicError(err.status, message, param, err.code, err.headers)


def is_messages_path(path: str) -> bool:
    return path == ROUTE or path.startswith(ROUTE + "/")


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error of a /v1/messages route in Anthropic's shape (the outer middleware writes it)."""
    if not is_messages_path(request.path):
        return await handler(request)
    try:
        return await handler(request)
    except AnthropicError:
        raise
    except ApiError as err:
        raise anthropic_error(err) from None
    except web.HTTPException as exc:  # the router's 404 / 405 under /v1/messages
        raise anthropic_error(from_http_exception(exc, request.method, request.path)) from None
    except Exception:
        request.app[CONTEXT].log.exception("unhandled error", method=request.method, path=request.path)
        raise AnthropicError(500, f"internal server error (request {request[REQUEST_ID]})", None,
                             "internal_error") from None


# ---------------------------------------------------------------------------------------- handlers

async def messages(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    arrival = time.monotonic()
    ctx.admission.check_open()
    req, thinking = await _chat_request(request, ctx, count=False)
    prepared = await prepare(req, ctx.front_door, ctx.limits, ctx.settings.quadrants, ctx.treatment)
    tracker = RequestTracker(request[REQUEST_ID], arrival, len(prepared.token_ids), prepared.quadrant)
    request[TRACKER] = tracker
    meta = MessageMeta(message_id(request[REQUEST_ID]), ctx.limits.name)
    with ctx.admission.slot(request[REQUEST_ID]):
        try:
            if req.stream:
                return await _stream(request, ctx, prepared, tracker, meta, thinking.shown)
            return await _whole(ctx, prepared, tracker, meta, thinking.shown)
        finally:
            ctx.metrics.record(tracker.record(time.monotonic()))


async def count_tokens(request: web.Request) -> web.Response:
    """`{"input_tokens"}`: the prompt /v1/messages would run for the same body (max_tokens not needed). A
    prompt longer than the context is counted, not refused: telling a client so is what this route is for."""
    ctx = request.app[CONTEXT]
    req, _ = await _chat_request(request, ctx, count=True)
    tools = ChatTools(req.tools, req.tool_choice, req.parallel_tool_calls)
    return web.json_response({"input_tokens": len(await encode_prompt(req, ctx.front_door, tools))})


async def _chat_request(request: web.Request, ctx: ServerContext, count: bool) -> tuple[GenerationRequest, Thinking]:
    body = parse_json_body(await read_body(request, ctx.settings.max_body_bytes))
    chat, thinking = _translated(body, ctx, count)
    req = parse_chat(chat, ctx.limits.name, ctx.defaults)
    # Anthropic's clients send a max_tokens sized for Claude (Claude Code: 32000), more than a local model's context
    # holds: it is a ceiling here, capped at the room the prompt leaves; a reply that fills it ends with max_tokens.
    sampling = dataclasses.replace(req.sampling, max_tokens_capped=True)
    return dataclasses.replace(req, sampling=sampling, thinking_budget=thinking.budget_tokens), thinking


def _translated(body: dict, ctx: ServerContext, count: bool) -> tuple[dict, Thinking]:
    """The chat body that asks for what `body` asks for, with the chat route's own fields it gives, and its
    thinking setting; 400 naming the field for what cannot be honoured."""
    try:
        chat, thinking = chat_body(body, count), thinking_of(body)
    except MessagesError as exc:
        raise bad_request(str(exc), exc.param) from None
    if thinking.asked and ctx.front_door.reasoning is None:
        raise bad_request("'thinking': the served model does not think in a separate channel (it has no reasoning "
                          "parser: see --reasoning-parser); send {\"type\": \"disabled\"} or leave it out.",
                          "thinking")
    try:
        return with_chat_fields(body, chat, thinking), thinking
    except MessagesError as exc:  # named as the client spelled it: no chat name to rename
        raise AnthropicError(400, str(exc), exc.param, "unsupported_parameter") from None


# ---------------------------------------------------------------------------------------- replies

async def _whole(ctx: ServerContext, prepared: Prepared, tracker: RequestTracker, meta: MessageMeta,
                 shown: bool) -> web.Response:
    final = None
    async with aclosing(engine_outputs(ctx, prepared, tracker)) as outputs:
        async for final in outputs:
            pass
    tracker.outcome = "ok"
    body = message_body(meta, final, prepared.tools, prepared.reasoning, shown)
    return web.json_response(body, headers=placement_headers(prepared, final))


async def _stream(request: web.Request, ctx: ServerContext, prepared: Prepared, tracker: RequestTracker,
                  meta: MessageMeta, shown: bool) -> web.StreamResponse:
    events = MessageEvents(meta, prepared.tools, prepared.reasoning, shown)
    async with aclosing(engine_outputs(ctx, prepared, tracker)) as outputs:
        first = await anext(outputs)  # before the headers, so that a refusal still gets its status code
        response = web.StreamResponse(headers=SSE_HEADERS | placement_headers(prepared, first))
        await response.prepare(request)
        tracker.streamed = True
        async with _stream_failures(ctx, response, tracker):
            await response.write(encode_events(events.opening(first) + events.events(first)))
            tracker.written(first, time.monotonic())
            async for out in outputs:
                await response.write(encode_events(events.events(out)))
                tracker.written(out, time.monotonic())
            await response.write(encode_events(events.closing(tracker.last)))
            tracker.outcome = "ok"
    return response


@asynccontextmanager
async def _stream_failures(ctx: ServerContext, response: web.StreamResponse,
                           tracker: RequestTracker) -> AsyncIterator[None]:
    """A failure once the headers are out ends the stream with an `error` event; a client that left ends it
    quietly (leaving aclosing() then aborts the request in the engine)."""
    try:
        yield
    except ConnectionError:
        tracker.outcome = "client_disconnected"
    except ApiError as err:
        await _end_with_error(response, tracker, anthropic_error(err), "aborted")
    except Exception:
        ctx.log.exception("stream failed")
        internal = AnthropicError(500, f"internal error while streaming (request {tracker.request_id})")
        await _end_with_error(response, tracker, internal, "error")


async def _end_with_error(response: web.StreamResponse, tracker: RequestTracker, err: AnthropicError,
                          outcome: str) -> None:
    tracker.outcome = outcome
    try:
        await response.write(encode_events([("error", err.body())]))
    except ConnectionError:
        tracker.outcome = "client_disconnected"
