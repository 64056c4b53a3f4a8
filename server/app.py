"""The aiohttp application: routes, middlewares (request ids, access log, errors, API key) and small handlers."""
from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from client import AsyncLLM
from engine.speculative.adaptive import SpecCounts
from server.context import API_ERROR, CONTEXT, REQUEST_ID, TRACKER, ServerContext
from server.errors import ApiError, error_response, from_http_exception
from server.generation import handle_generation
from server.logging import make_logger
from server.messages_api import anthropic_errors, count_tokens, messages
from server.metrics import UNMATCHED_ROUTE, kv_tiers_status, spec_summary
from server.protocol import model_not_found
from server.responses import model_card, model_list
from server.responses_api import add_responses_routes
from server.settings import ServerSettings
from server.embeddings import embeddings
from server.utility import detokenize, tokenize

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CLIENT_CLOSED = 499  # nginx's status for "the client went away before the answer"
ID_PREFIXES = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-", "/v1/embeddings": "embd-"}


def create_app(llm: AsyncLLM, settings: ServerSettings,
               log: structlog.stdlib.BoundLogger | None = None) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_request_scope, anthropic_errors,
                                                                               _require_api_key])
    app[CONTEXT] = ServerContext.build(llm, settings, log or make_logger())
    app.on_response_prepare.append(_add_request_id_header)
    app.add_routes([web.post("/v1/completions", _completions), web.post("/v1/chat/completions", _chat),
                    web.get("/v1/models", _models), web.get("/v1/models/{model:.+}", _model_card),
                    web.post("/tokenize", tokenize), web.post("/detokenize", detokenize),
                    web.post("/v1/embeddings", embeddings),
                    web.post("/v1/messages", messages), web.post("/v1/messages/count_tokens", count_tokens),
                    web.get("/health", _health), web.get("/metrics", _metrics),
                    web.get("/status", _status), web.post("/admin/drain", _drain)])
    add_responses_routes(app, settings)
    return app


def new_request_id(path: str) -> str:
    return ID_PREFIXES.get(path, "req-") + uuid.uuid4().hex


# ---------------------------------------------------------------------------------------- middlewares

@web.middleware
async def _request_scope(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Binds the request id to every log line of the request, turns errors into OpenAI-shaped JSON and writes
    exactly one access line."""
    ctx = request.app[CONTEXT]
    request[REQUEST_ID] = new_request_id(request.path)
    started, status = time.monotonic(), 500
    with structlog.contextvars.bound_contextvars(request_id=request[REQUEST_ID]):
        try:
            response = await _json_errors(ctx, request, handler)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            _access_line(ctx, request, status, time.monotonic() - started)
            ctx.metrics.http_response(_route_of(request), request.method, status)


def _route_of(request: web.Request) -> str:
    """The matched route's path (a bounded label), or UNMATCHED_ROUTE for a 404 / 405."""
    resource = request.match_info.route.resource
    return UNMATCHED_ROUTE if resource is None else resource.canonical


async def _json_errors(ctx: ServerContext, request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _error(request, err)
    except web.HTTPException as exc:  # the router's 404 / 405
        return _error(request, from_http_exception(exc, request.method, request.path))
    except Exception:
        ctx.log.exception("unhandled error", method=request.method, path=request.path)
        return _error(request, ApiError(500, f"internal server error (request {request[REQUEST_ID]})", None,
                                        "internal_error"))


def _error(request: web.Request, err: ApiError) -> web.Response:
    request[API_ERROR] = err  # the access line says why
    return error_response(err)


def _access_line(ctx: ServerContext, request: web.Request, status: int, seconds: float) -> None:
    tracker = request.get(TRACKER)
    usage = {} if tracker is None else {
        "prompt_tokens": tracker.prompt_tokens, "completion_tokens": tracker.completion_tokens,
        "ttft": None if tracker.ttft is None else round(tracker.ttft, 4), "quadrant": tracker.quadrant.value,
        "outcome": "cancelled" if status == CLIENT_CLOSED else tracker.outcome}
    if tracker is not None and tracker.last is not None and tracker.last.moves:
        usage["migrated"] = ", ".join(tracker.last.moves)  # the decode actors the stream moved between
    err = request.get(API_ERROR)
    why = {} if err is None else {"code": err.code, "param": err.param}  # a 4xx says what the client got wrong
    ctx.log.info("access", method=request.method, path=request.path, status=status,
                 total_time=round(seconds, 4), **usage, **why)


@web.middleware
async def _require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[CONTEXT].settings.api_key
    if key is None or not request.path.startswith(("/v1/", "/admin/")):
        return await handler(request)
    bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    given = [k for k in (bearer, request.headers.get("x-api-key", "").strip()) if k]  # OpenAI's, Anthropic's
    if not any(hmac.compare_digest(k.encode(), key.encode()) for k in given):
        raise ApiError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                       None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]


# ---------------------------------------------------------------------------------------- handlers

async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, request.app[CONTEXT], chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, request.app[CONTEXT], chat=True)


async def _models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    return web.json_response(model_list(ctx.limits.name, ctx.created, ctx.limits.max_model_len,
                                        active_defaults(ctx)))


async def _model_card(request: web.Request) -> web.Response:
    """OpenAI's model object for the served model; 404 model_not_found for any other id."""
    ctx = request.app[CONTEXT]
    name = request.match_info["model"]
    if name != ctx.limits.name:
        raise model_not_found(name, ctx.limits.name)
    return web.json_response(model_card(ctx.limits.name, ctx.created, ctx.limits.max_model_len,
                                        active_defaults(ctx)))


def active_defaults(ctx: ServerContext) -> dict:
    """The defaults of fields a request leaves out: the model's generation_config.json ones, the max_tokens
    cap, the tool-call format and the reasoning parser."""
    return {"generation_config": ctx.generation_defaults, "max_tokens": ctx.defaults.max_tokens,
            "tool_call_parser": ctx.front_door.tool_format.value,
            "reasoning_parser": ctx.front_door.reasoning_name}


async def _health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.admission.check_open()
    if not ctx.llm.can_serve():
        raise ApiError(503, "no decode actor can take work right now", None, "no_capacity")
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _drain(request: web.Request) -> web.Response:
    """POST /admin/drain?actor=ID: move the actor's streams to others (or to its replacement), then restart it."""
    actor = request.query.get("actor")
    if not actor:
        raise ApiError(400, "name the actor to drain: POST /admin/drain?actor=ID (GET /status lists them)",
                       "actor", "missing_actor")
    try:
        moved = await request.app[CONTEXT].llm.drain(actor)
    except KeyError:
        raise ApiError(404, f"there is no actor {actor!r} (GET /status lists them)", "actor",
                       "actor_not_found") from None
    except ValueError as exc:
        raise ApiError(409, str(exc), "actor", "cannot_drain") from None
    return web.json_response({"actor": actor, "moved_requests": moved, "status": "draining"})


async def _status(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    s = ctx.llm.stats()
    return web.json_response({
        "model": ctx.limits.name, "dtype": ctx.dtype, "max_model_len": ctx.limits.max_model_len,
        "running": s.running, "waiting": s.waiting, "in_flight": len(ctx.admission.active_ids),
        "draining": ctx.admission.draining,
        "kv_blocks": {"total": s.kv_blocks_total, "used": s.kv_blocks_used, "cached": s.kv_blocks_cached,
                      "compressed": s.kv_blocks_compressed, "compressed_capacity": s.kv_blocks_cold_total,
                      "compressions": s.kv_compressions},
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "prefix_cache": {"queries": s.prefix_queries, "hits": s.prefix_hits},
        "kv_tiers": kv_tiers_status(s),
        "preemptions": s.num_preemptions,
        "speculation": spec_summary(SpecCounts(s.spec_proposed, s.spec_accepted, s.spec_steps))
        | {"by_quadrant": ctx.metrics.speculation_by_quadrant()},
        "backend": ctx.llm.backend(), "actors": ctx.llm.actors(), "calibration": ctx.llm.calibration(),
        "layout": ctx.llm.layout_status()})
