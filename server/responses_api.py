"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed as typed events), and `GET` / `DELETE
/v1/responses/{id}` and `POST /v1/responses/{id}/cancel` on the stored ones.

A request is translated into the chat request the chat route prepares (server/responses_request.py) and runs
through the same preparation, admission, engine stream and metrics (server/generation.py); only the shapes of
the answer are this route's own (server/responses_events.py). A stream waits for the engine's first output
before its headers, so that a refusal still gets its status; a client that leaves mid-stream ends it, and
leaving `aclosing()` aborts its engine request. `background` is refused (server/responses_fields.py), so the
cancel route has no running response to cancel: it answers 404 for an unknown id and 400 for a stored one.
"""
from __future__ import annotations

import hashlib
import time
from contextlib import aclosing, asynccontextmanager
from typing import AsyncIterator, Callable

from aiohttp import web

from engine.core.outputs import RequestOutput
from frontend.responses_items import input_items
from server.context import CONTEXT, REQUEST_ID, TRACKER, ServerContext
from server.errors import ApiError, bad_request
from server.generation import (Prepared, RequestTracker, engine_outputs, placement_headers, prepare,
                               read_body)
from server.protocol import parse_json_body
from server.responses import reasoning_usage
from server.responses_events import (OutputBuilder, OutputFeed, ResponseHead, encode, final_status,
                                     response_object, response_usage, whole_output)
from server.responses_request import ResponsesRequest, parse_responses, renamed, responses_names
from server.responses_store import ResponseStore
from server.settings import ServerSettings
from server.streaming import SSE_HEADERS

Keep = Callable[[dict, list], None]  # stores a finished response's body and output items, as the request asked
RESPONSE_STORE = web.AppKey("phase_serve_responses", ResponseStore)


def add_responses_routes(app: web.Application, settings: ServerSettings) -> None:
    """The Responses routes, and the store the app keeps their responses in."""
    app[RESPONSE_STORE] = ResponseStore(settings.store_limits())
    app.add_routes([web.post("/v1/responses", create_response), web.get("/v1/responses/{id}", get_response),
                    web.delete("/v1/responses/{id}", delete_response),
                    web.post("/v1/responses/{id}/cancel", cancel_response)])


def owner_of(request: web.Request) -> str:
    """Who a stored response belongs to: a digest of the bearer token the request presented (none: "")."""
    token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


def response_id(request: web.Request) -> str:
    """The response's id: the request id's random part, so that logs and X-Request-Id lead to it."""
    return "resp_" + request[REQUEST_ID].rsplit("-", 1)[-1]


# ---------------------------------------------------------------------------------------- POST /v1/responses

async def create_response(request: web.Request) -> web.StreamResponse:
    ctx, store = request.app[CONTEXT], request.app[RESPONSE_STORE]
    arrival = time.monotonic()
    ctx.admission.check_open()
    body = parse_json_body(await read_body(request, ctx.settings.max_body_bytes))
    owner = owner_of(request)
    parsed = parse_responses(body, ctx.limits.name, ctx.defaults, lambda rid: store.get(rid, owner))
    with responses_names():
        prepared = await prepare(parsed.chat, ctx.front_door, ctx.limits, ctx.settings.quadrants, ctx.treatment)
    tracker = RequestTracker(request[REQUEST_ID], arrival, len(prepared.token_ids), prepared.quadrant)
    request[TRACKER] = tracker
    head = ResponseHead(response_id(request), int(time.time()), ctx.limits.name, parsed.echo)
    run = ResponseRun(ctx, prepared, parsed, head, tracker)
    with ctx.admission.slot(tracker.request_id):
        try:
            if parsed.stream:
                return await run.stream(request, lambda body, output: _keep(store, owner, parsed, body, output))
            return await run.whole(lambda body, output: _keep(store, owner, parsed, body, output))
        finally:
            ctx.metrics.record(tracker.record(time.monotonic()))


def _keep(store: ResponseStore, owner: str, parsed: ResponsesRequest, body: dict, output: list[dict]) -> None:
    """Stores a finished response when the request asked to; its `store` says whether it was kept (one larger
    than the store's byte limit alone is not). The conversation a later turn continues holds the output as
    input items, without a call that max_output_tokens cut (its arguments are no JSON, and no one can answer it)."""
    if not parsed.store:
        body["store"] = False
        return
    said = [item for item in output if not (item["type"] == "function_call" and item["status"] == "incomplete")]
    body["store"] = store.put(body["id"], owner, body | {"store": True}, [*parsed.conversation, *input_items(said)])


class ResponseRun:
    """One response's engine request, answered whole or as a stream of typed events."""

    def __init__(self, ctx: ServerContext, prepared: Prepared, parsed: ResponsesRequest, head: ResponseHead,
                 tracker: RequestTracker) -> None:
        self.ctx, self.prepared, self.parsed, self.head, self.tracker = ctx, prepared, parsed, head, tracker
        self.builder = OutputBuilder()

    async def whole(self, keep: Keep) -> web.Response:
        final: RequestOutput | None = None
        with responses_names():
            async with aclosing(engine_outputs(self.ctx, self.prepared, self.tracker)) as outputs:
                async for final in outputs:
                    pass
        self.tracker.outcome = "ok"
        status = final_status(final)
        output = whole_output(self.builder, final.outputs[0].text, self.prepared.tools, status,
                              self.prepared.reasoning)
        body = response_object(self.head, status, output, self._usage(final))
        keep(body, output)
        return web.json_response(body, headers=placement_headers(self.prepared, final))

    async def stream(self, request: web.Request, keep: Keep) -> web.StreamResponse:
        async with aclosing(engine_outputs(self.ctx, self.prepared, self.tracker)) as outputs:
            with responses_names():
                first = await anext(outputs)  # before the headers, so that a refusal still gets its status code
            response = web.StreamResponse(headers=SSE_HEADERS | placement_headers(self.prepared, first))
            await response.prepare(request)
            self.tracker.streamed = True
            async with self._failures(response):
                await self._pump(response, first, outputs, keep)
        return response

    async def _pump(self, response: web.StreamResponse, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                    keep: Keep) -> None:
        builder, feed = self.builder, OutputFeed(self.builder, self.prepared.tools, self.prepared.reasoning)
        opening = [builder.event(kind, response=response_object(self.head, "in_progress", []))
                   for kind in ("response.created", "response.in_progress")]
        await response.write(encode(opening + feed.feed(first)))
        self.tracker.written(first, time.monotonic())
        async for out in outputs:
            await response.write(encode(feed.feed(out)))
            self.tracker.written(out, time.monotonic())
        last = self.tracker.last
        status = final_status(last)
        closing = builder.finish(status)
        body = response_object(self.head, status, builder.items, self._usage(last))
        keep(body, builder.items)
        await response.write(encode(closing + [builder.event(f"response.{status}", response=body)]))
        self.tracker.outcome = "ok"

    def _usage(self, final: RequestOutput) -> dict:
        return response_usage(final, reasoning_usage(final, self.ctx.llm.tokenizer, self.prepared.reasoning))

    @asynccontextmanager
    async def _failures(self, response: web.StreamResponse) -> AsyncIterator[None]:
        """A failure once the headers are out ends the stream with an `error` event and `response.failed`; a
        client that left ends it quietly (leaving aclosing() then aborts the engine request)."""
        try:
            yield
        except ConnectionError:
            self.tracker.outcome = "client_disconnected"
        except ApiError as err:
            await self._fail(response, renamed(err), "aborted")
        except Exception:
            self.ctx.log.exception("stream failed")
            await self._fail(response, ApiError(500, f"internal error while streaming (request "
                                                     f"{self.tracker.request_id})", None, "internal_error"), "error")

    async def _fail(self, response: web.StreamResponse, err: ApiError, outcome: str) -> None:
        self.tracker.outcome = outcome
        builder = self.builder
        failed = response_object(self.head, "failed", builder.output, error={"code": err.code or "server_error",
                                                                             "message": err.message})
        events = [builder.event("error", code=err.code, message=err.message, param=err.param),
                  builder.event("response.failed", response=failed)]
        try:
            await response.write(encode(events))
        except ConnectionError:
            self.tracker.outcome = "client_disconnected"


# ---------------------------------------------------------------------------------------- stored responses

def not_found(rid: str) -> ApiError:
    return ApiError(404, f"there is no stored response '{rid}': it was never stored here (store: false), was "
                    "deleted, has expired, or belongs to another API key.", "response_id", "response_not_found")


def _stored(request: web.Request) -> tuple[str, bytes]:
    rid = request.match_info["id"]
    entry = request.app[RESPONSE_STORE].get(rid, owner_of(request))
    if entry is None:
        raise not_found(rid)
    return rid, entry.body


async def get_response(request: web.Request) -> web.Response:
    _, body = _stored(request)
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("'stream' replays a background response's events, and this server runs none in the "
                          "background; GET the response without it.", "stream", "unsupported_parameter")
    return web.Response(body=body, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    if not request.app[RESPONSE_STORE].delete(rid, owner_of(request)):
        raise not_found(rid)
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    rid, _ = _stored(request)
    raise bad_request(f"response '{rid}' is finished: only background responses can be cancelled, and this server "
                      "runs none ('background' is refused).", None, "not_cancellable")
