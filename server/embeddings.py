"""POST /v1/embeddings in OpenAI's shape, for the served generation model.

Each input runs as its own engine request on the engine that generates (`AsyncLLM.embed`: the same scheduler,
the same decode actors, no second copy of the model), as a prefill whose final hidden states (after the final
norm) are pooled as `--pooling` says, last token or mean, and L2-normalised. Each input is classified as a prompt
with a one-token output (SISO, or LISO when long) and placed as such, but always prefilled where it runs: a
hand-off would leave nothing to decode. The one token it samples is dropped.

`dimensions` is refused unless it is the model's own width: a generation model's pooled state is not trained
to keep its meaning when truncated (Matryoshka), so a shorter vector would be a different, unannounced thing.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from engine.core.outputs import EmbeddingOutput
from server.context import CONTEXT, REQUEST_ID, TRACKER, ServerContext
from server.errors import ApiError, bad_request, invalid_type, json_type
from server.generation import RequestTracker, TrackerGroup, engine_errors, read_body
from server.protocol import ModelLimits, check_model_name, parse_json_body
from server.quadrant import Quadrant, classify, treatment_for

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = ("float", "base64")
# Fields of other servers' embeddings APIs that would change the vectors in ways this server does not implement:
# (why, the values that pass because they ask for what is done anyway).
REFUSED_FIELDS = {
    "truncate_prompt_tokens": ("inputs are embedded whole; a too-long input is refused", (None,)),
    "normalize": ("vectors are always L2-normalised", (None, True)),
    "messages": ("chat embeddings are not implemented; send the rendered text as 'input'", (None,)),
    "embed_dtype": ("vectors are float32", (None, "float32")),
}


@dataclass(frozen=True)
class EmbeddingRequest:
    """A parsed /v1/embeddings body: the inputs (text or token ids) in order and how to encode the vectors."""

    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    add_special_tokens: bool = True


# ---------------------------------------------------------------------------------------- parsing

def parse_embedding_request(body: dict[str, Any], served_model: str, hidden_size: int) -> EmbeddingRequest:
    """The body's fields checked and typed; a 400 naming the first bad field."""
    model = served_model if body.get("model") is None else body["model"]
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    check_model_name(model, served_model)
    for name, (why, passing) in REFUSED_FIELDS.items():
        given = body.get(name)
        if not any(given is ok or (isinstance(ok, str) and given == ok) for ok in passing):
            raise bad_request(f"'{name}' is not supported on /v1/embeddings: {why}.", name, "unsupported_parameter")
    _check_dimensions(body.get("dimensions"), hidden_size)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid_type("user", "a string", body["user"])
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise bad_request(f"'encoding_format' must be float or base64, got {_shown(fmt)}.", "encoding_format")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise invalid_type("add_special_tokens", "a boolean", special)
    return EmbeddingRequest(_inputs(body.get("input")), fmt or "float", special)


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json_type(value)


def _check_dimensions(value: Any, hidden_size: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type("dimensions", "an integer", value)
    if value != hidden_size:
        raise bad_request(f"'dimensions' {value} is not supported: this model's embeddings have {hidden_size} "
                          "dimensions, and a generation model's pooled state is not trained to be truncated; leave "
                          f"'dimensions' out or send {hidden_size}.", "dimensions", "unsupported_parameter")


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four shapes: a string, an array of strings, an array of token ids, an array of token-id arrays."""
    if value is None:
        raise bad_request("'input' is required.", "input", "missing_required_parameter")
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(t) for t in value)):
        return (_one_input(value, "input"),)
    if not isinstance(value, list):
        raise invalid_type("input", "a string, an array of strings or an array of token ids", value)
    if not value:
        raise bad_request("'input' must hold at least one input.", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} are taken at once.", "input")
    return tuple(_one_input(item, f"input[{i}]") for i, item in enumerate(value))


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_input(item: Any, where: str) -> str | tuple[int, ...]:
    if isinstance(item, list) and item and all(_is_token(t) for t in item):
        return tuple(item)
    if not isinstance(item, str):
        raise bad_request(f"'{where}' must be a string or an array of token ids, got {json_type(item)}.", "input",
                          "invalid_type")
    if not item:
        raise bad_request(f"'{where}' must not be empty.", "input")
    return item


def check_input_tokens(token_ids: Sequence[int], limits: ModelLimits, where: str) -> None:
    """An input the engine can embed: inside the vocabulary, and shorter than the context (the engine samples one
    token after it, which is dropped)."""
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"'{where}' holds token id {bad}, outside this model's vocabulary of {limits.vocab_size}.",
                          "input")
    if not token_ids:
        raise bad_request(f"'{where}' is empty once tokenised.", "input")
    if len(token_ids) >= limits.max_model_len:
        raise bad_request(f"'{where}' has {len(token_ids)} tokens; this model embeds at most "
                          f"{limits.max_model_len - 1} (its context is {limits.max_model_len}).", "input",
                          "context_length_exceeded")


# ---------------------------------------------------------------------------------------- the answer

def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """float: the values; base64: their little-endian float32 bytes, as OpenAI sends them."""
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(outputs: Sequence[EmbeddingOutput], model: str, encoding_format: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(out.embedding, encoding_format)}
            for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# ---------------------------------------------------------------------------------------- running

async def embed_all(ctx: ServerContext, token_lists: list[list[int]], ids: list[str],
                    quadrants: list[Quadrant]) -> list[EmbeddingOutput]:
    """Every input as its own engine request, concurrently; the first failure aborts the others and is raised
    as the client's error."""
    tasks = [asyncio.ensure_future(_embed_one(ctx, tokens, rid, q))
             for tokens, rid, q in zip(token_lists, ids, quadrants)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _embed_one(ctx: ServerContext, token_ids: list[int], request_id: str, quadrant: Quadrant) -> EmbeddingOutput:
    with engine_errors("input"):
        return await ctx.llm.embed(token_ids, request_id=request_id, treatment=treatment_for(quadrant, ctx.treatment))


async def _tokens(ctx: ServerContext, req: EmbeddingRequest) -> list[list[int]]:
    token_lists = []
    for i, item in enumerate(req.inputs):
        where = "input" if len(req.inputs) == 1 else f"input[{i}]"
        tokens = await ctx.front_door.encode_async(item, req.add_special_tokens) if isinstance(item, str) \
            else list(item)
        check_input_tokens(tokens, ctx.limits, where)
        token_lists.append(tokens)
    return token_lists


async def embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings: every input checked before any runs, each a slot of the in-flight limit."""
    ctx = request.app[CONTEXT]
    arrival = time.monotonic()
    ctx.admission.check_open()
    body = parse_json_body(await read_body(request, ctx.settings.max_body_bytes))
    req = parse_embedding_request(body, ctx.limits.name, ctx.llm.source.config.hidden_size)
    if len(req.inputs) > ctx.settings.max_queue:
        raise bad_request(f"'input' holds {len(req.inputs)} inputs; this server runs at most {ctx.settings.max_queue} "
                          "requests at once (--max-queue), so send them in smaller lists.", "input")
    token_lists = await _tokens(ctx, req)
    quadrants = [classify(len(tokens), 1, ctx.settings.quadrants) for tokens in token_lists]
    rid = request[REQUEST_ID]
    ids = [rid] if len(token_lists) == 1 else [f"{rid}-{i}" for i in range(len(token_lists))]
    group = request[TRACKER] = TrackerGroup([RequestTracker(i, arrival, len(t), q)
                                             for i, t, q in zip(ids, token_lists, quadrants)])
    with ExitStack() as slots:
        for one in ids:
            slots.enter_context(ctx.admission.slot(one))
        outputs = await embed_all(ctx, token_lists, ids, quadrants)
    group.outcome = "ok"
    return web.json_response(embeddings_body(outputs, ctx.limits.name, req.encoding_format),
                             headers={"X-Quadrant": ",".join(q.value for q in quadrants)})
