"""One generation request end to end: read and validate, tokenise, admit, run on the engine, answer whole or
as server-sent events, and record its metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import ExitStack, aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from aiohttp import web

from client.async_llm import RequestAbortedError
from engine.core.client_protocol import NoCapacityError, RequestFailedError
from engine.core.errors import GUIDE_PARAM, RequestError
from engine.core.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from engine.model.tokenizer import Tokenizer
from engine.core.treatment import Treatment
from frontend.chat import ChatTemplateError
from frontend.front_door import ChatTools, FrontDoor, ThinkingBudgetError
from frontend.output import ReasoningOutput, ToolCallOutput
from server.context import REQUEST_ID, TRACKER, ServerContext
from server.errors import ApiError, bad_request
from server.fim import fim_prompt, fim_tokens
from server.metrics import RequestRecord
from server.prompt_logprobs import add_prompt_logprobs
from server.protocol import (GenerationRequest, Message, ModelLimits, check_prompt_tokens, effective_max_tokens,
                             messages_as_dicts, parse_chat, parse_completion, parse_json_body, sampling_params)
from server.quadrant import Quadrant, QuadrantThresholds, TreatmentOptions, classify, treatment_for
from server.responses import (ResponseMeta, best_of_outputs, chat_body, completion_body, output_usage,
                              summed_usage, usage_chunk)
from server.streaming import DONE, SSE_HEADERS, ChunkBuilder, encode_events, sse_event

NO_CAPACITY_RETRY_AFTER = 5  # seconds: about what an actor restart takes
SHUTTING_DOWN = "server shutting down"


@dataclass(frozen=True)
class Prepared:
    request: GenerationRequest
    token_ids: list[int]
    params: SamplingParams
    quadrant: Quadrant
    treatment: Treatment
    tools: ToolCallOutput | None = None  # how to read tool calls out of the output; None: plain text
    guide_param: str = "response_format"  # the request field that set params.guide, for the engine's refusal
    reasoning: ReasoningOutput | None = None  # how to split the thinking off the answer; None: no thinking


@dataclass
class RequestTracker:
    """What the access log and the metrics need to know about one request as it runs. A stream's token times
    are when each token (of the first sample) was written to the client; a whole response's are when the
    engine's outputs arrived."""

    request_id: str
    arrival: float  # time.monotonic() when the HTTP request came in
    prompt_tokens: int
    quadrant: Quadrant
    last: RequestOutput | None = None
    outcome: str = "pending"
    streamed: bool = False
    delivered: list[float] = field(default_factory=list)  # streams: the write time of each token

    def written(self, out: RequestOutput, now: float) -> None:
        """`out`'s new tokens have just been written to the client."""
        self.delivered.extend([now] * len(out.outputs[0].delta_token_ids))

    @property
    def completion_tokens(self) -> int:
        return 0 if self.last is None else sum(len(o.token_ids) for o in self.last.outputs)

    @property
    def token_times(self) -> list[float]:
        if self.streamed:
            return self.delivered
        return [] if self.last is None else self.last.metrics.token_times

    @property
    def ttft(self) -> float | None:
        times = self.token_times
        return times[0] - self.arrival if times else None

    def record(self, now: float) -> RequestRecord:
        outputs = self.last.outputs if self.last is not None and self.last.finished else []
        times = self.token_times
        gaps = tuple(b - a for a, b in zip(times, times[1:]))
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        path = "colocated" if self.last is None else self.last.path
        queue, prefill, decode = self.phases()
        return RequestRecord(self.quadrant.value, path, self.prompt_tokens, self.completion_tokens,
                             tuple(o.finish_reason for o in outputs), self.ttft, gaps, tpot, now - self.arrival,
                             None if self.last is None else self.last.spec, queue, prefill, decode,
                             placed=self.last is not None)

    def phases(self) -> tuple[float | None, float | None, float | None]:
        """(queue, prefill, decode) seconds: HTTP arrival to submission to the engine, submission to the first
        token's arrival from the engine, first to last token's arrival (engine-side times, whatever the
        stream's pacing)."""
        if self.last is None:
            return None, None, None
        engine = self.last.metrics
        times = engine.token_times
        queue = max(0.0, engine.arrival_time - self.arrival)
        prefill = times[0] - engine.arrival_time if times else None
        decode = times[-1] - times[0] if times else None
        return queue, prefill, decode


@dataclass
class TrackerGroup:
    """The trackers of one HTTP request: one per prompt (a completion's prompt list has several), summed for
    the access line."""

    trackers: list[RequestTracker]

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.trackers)

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.trackers)

    @property
    def ttft(self) -> float | None:
        times = [t.ttft for t in self.trackers if t.ttft is not None]
        return min(times) if times else None

    @property
    def quadrant(self) -> Quadrant:
        return self.trackers[0].quadrant

    @property
    def last(self) -> RequestOutput | None:
        """The output whose migrations the access line names: the first prompt's that moved, else the first's."""
        moved = [t.last for t in self.trackers if t.last is not None and t.last.moves]
        return moved[0] if moved else self.trackers[0].last

    @property
    def outcome(self) -> str:
        return next((t.outcome for t in self.trackers if t.outcome != "ok"), "ok")

    @outcome.setter
    def outcome(self, value: str) -> None:
        for t in self.trackers:
            t.outcome = value

    def streamed(self) -> None:
        for t in self.trackers:
            t.streamed = True


# ---------------------------------------------------------------------------------------- preparation

async def read_body(request: web.Request, limit: int) -> bytes:
    """The body; aiohttp refuses to read more than the app's client_max_size (set to `limit`)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than the limit of {limit} bytes", None,
                       "body_too_large") from None


async def prepare(req: GenerationRequest, door: FrontDoor, limits: ModelLimits, thresholds: QuadrantThresholds,
                  treatments: TreatmentOptions = TreatmentOptions()) -> Prepared:
    """The request through the model's front door: its prompt rendered and tokenised, its SamplingParams with
    the constraint of a forced tool call (past the thinking, for a model that thinks), and the readers of its
    tool calls and reasoning. A constraint is not compiled here: the engine compiles it where it runs, and its
    refusal becomes a 400 in engine_outputs."""
    tools = ChatTools(req.tools, req.tool_choice, req.parallel_tool_calls)
    chat_text, ids = await _rendered_prompt(req, door, tools)
    token_ids = req.sampling.params.truncated_prompt(ids, limits.max_model_len)
    check_prompt_tokens(token_ids, limits, req.prompt_param)
    params = _best_of(req, sampling_params(req.sampling, len(token_ids), limits))
    params, reader = door.with_tools(params, tools)
    params, reasoning = _with_reasoning(req, door, params, chat_text)
    guide_param = "tools" if reader is not None and tools.choice.forced else req.sampling.guide_param
    quadrant = classify(len(token_ids), effective_max_tokens(req.sampling, len(token_ids), limits), thresholds)
    return Prepared(req, token_ids, params, quadrant, treatment_for(quadrant, treatments), reader, guide_param,
                    reasoning)


def _with_reasoning(req: GenerationRequest, door: FrontDoor, params: SamplingParams, chat_text: str | None
                    ) -> tuple[SamplingParams, ReasoningOutput | None]:
    """A chat's params with its reasoning's constraint and budget, and the reader of its reasoning."""
    if not req.chat:
        return params, None
    try:
        return door.with_reasoning(params, chat_text, req.thinking_budget)
    except ThinkingBudgetError as exc:
        raise bad_request(f"'thinking_budget': {exc}", "thinking_budget") from None


def _best_of(req: GenerationRequest, params: SamplingParams) -> SamplingParams:
    """best_of samples, each with its tokens' logprobs (to rank them by their sum)."""
    if req.best_of is None:
        return params
    try:
        return dataclasses.replace(params, n=req.best_of, logprobs=params.logprobs or 0)
    except SamplingParamsError as exc:
        raise bad_request(str(exc).replace("n must", "best_of must", 1), "best_of") from None


async def encode_prompt(req: GenerationRequest, door: FrontDoor, tools: ChatTools) -> list[int]:
    """The request's prompt as the token ids it runs (before any truncate_prompt_tokens)."""
    return (await _rendered_prompt(req, door, tools))[1]


async def _rendered_prompt(req: GenerationRequest, door: FrontDoor, tools: ChatTools
                           ) -> tuple[str | None, list[int]]:
    """(the rendered chat, or None for a completion; the prompt's token ids)."""
    if req.suffix is not None:
        return None, await door.encode_async(_fill_in_the_middle(door.tokenizer, req), add_special_tokens=True)
    if isinstance(req.prompt, str):
        return None, await door.encode_async(req.prompt, add_special_tokens=True)
    if not req.chat:
        return None, list(req.prompt)
    text = render_chat(door, req.prompt, tools, req.add_generation_prompt, req.template_kwargs)
    return text, await door.encode_async(text, add_special_tokens=False)


def _fill_in_the_middle(tokenizer: Tokenizer, req: GenerationRequest) -> str:
    tokens = fim_tokens(tokenizer)
    if tokens is None:
        raise bad_request("'suffix' needs fill-in-the-middle tokens, and this model's vocabulary has none "
                          "(<fim_prefix>/<fim_suffix>/<fim_middle> or the like).", "suffix", "unsupported_parameter")
    prompt = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(list(req.prompt),
                                                                               skip_special_tokens=False)
    return fim_prompt(tokens, prompt, req.suffix or "")


def render_chat(door: FrontDoor, messages: tuple[Message, ...], tools: ChatTools, add_generation_prompt: bool,
                template_kwargs: dict | None = None) -> str:
    """The chat's prompt text; 400 naming `messages` when the model's chat template refuses them."""
    try:
        return door.render_chat(messages_as_dicts(messages), tools, add_generation_prompt, template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


# ---------------------------------------------------------------------------------------- running

async def engine_outputs(ctx: ServerContext, prepared: Prepared, tracker: RequestTracker
                         ) -> AsyncIterator[RequestOutput]:
    """The engine's outputs, with its refusals as 400s, a shutdown abort as 503, no decode actor up in time as
    503 with Retry-After, and a request the actors could not complete as 503 naming the cause. Close it with
    aclosing(): closing it early aborts the request in the engine."""
    stream = ctx.llm.generate(prepared.token_ids, prepared.params, request_id=tracker.request_id,
                              priority=prepared.request.priority, treatment=prepared.treatment)
    async with aclosing(stream):
        with engine_errors(prepared.guide_param):
            async for out in stream:
                tracker.last = out
                if any(o.finish_reason == "abort" for o in out.outputs):
                    raise ApiError(503, SHUTTING_DOWN, None, "shutting_down")
                yield out


@contextmanager
def engine_errors(param: str) -> Iterator[None]:
    """The engine's errors as the API's: a refusal as a 400 naming `param`, a shutdown abort as 503, no decode
    actor up in time as 503 with Retry-After, a request the actors could not complete as 503 naming the cause."""
    try:
        yield
    except RequestError as exc:
        raise refusal(exc, param) from None
    except RequestAbortedError:
        raise ApiError(503, SHUTTING_DOWN, None, "shutting_down") from None
    except NoCapacityError as exc:
        raise ApiError(503, f"no capacity: {exc}; retry later", None, "no_capacity",
                       {"Retry-After": str(NO_CAPACITY_RETRY_AFTER)}) from None
    except RequestFailedError as exc:
        raise ApiError(503, f"the request could not be completed: {exc}", None, "engine_failure") from None


def refusal(exc: RequestError, guide_param: str) -> ApiError:
    """The engine's refusal as a 400; a constraint it cannot compile names the field that set it."""
    if exc.param == GUIDE_PARAM:
        return bad_request(f"'{guide_param}': {exc}", guide_param)
    return bad_request(str(exc), exc.param)


async def whole_response(ctx: ServerContext, parts: list[Prepared], group: TrackerGroup,
                         meta: ResponseMeta) -> web.Response:
    if len(parts) == 1:
        final = None
        async with aclosing(engine_outputs(ctx, parts[0], group.trackers[0])) as outputs:
            async for final in outputs:
                pass
        group.outcome = "ok"
        return web.json_response(response_body(parts[0], meta, final, ctx.llm.tokenizer),
                                 headers=placement_headers(parts[0], final))
    finals: list[RequestOutput | None] = [None] * len(parts)
    async with aclosing(MergedOutputs(ctx, parts, group.trackers)) as outputs:
        async for i, out in outputs:
            finals[i] = out
    group.outcome = "ok"
    bodies = [response_body(p, meta, f, ctx.llm.tokenizer) for p, f in zip(parts, finals)]
    body = bodies[0] | {"choices": [c for i, b in enumerate(bodies) for c in _offset(b["choices"], i, parts)],
                        "usage": summed_usage([b["usage"] for b in bodies])}
    return web.json_response(body, headers=batch_headers(parts, finals))


def _offset(choices: list[dict], prompt_index: int, parts: list[Prepared]) -> list[dict]:
    """A prompt's choices renumbered for the whole list: prompt i, sample j -> index i * n + j (OpenAI's and
    vLLM's order)."""
    n = parts[prompt_index].request.sampling.params.n
    for choice in choices:
        choice["index"] += prompt_index * n
    return choices


class MergedOutputs:
    """The outputs of several engine requests (a completion's prompt list) as one stream of (prompt index,
    output), in arrival order: each runs as its own engine request, concurrently. The first failure ends the
    stream with that error; aclose() (and so any early exit) aborts the requests still running."""

    def __init__(self, ctx: ServerContext, parts: list[Prepared], trackers: list[RequestTracker]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(parts)
        self._tasks = [asyncio.create_task(self._drain(i, engine_outputs(ctx, p, t)))
                       for i, (p, t) in enumerate(zip(parts, trackers))]

    async def _drain(self, index: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, None))
        except Exception as exc:  # handed to the reader, which raises it
            self._queue.put_nowait((index, exc))

    def __aiter__(self) -> MergedOutputs:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._running:
            index, item = await self._queue.get()
            if item is None:
                self._running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def response_body(prepared: Prepared, meta: ResponseMeta, final: RequestOutput, tokenizer: Tokenizer) -> dict:
    req = prepared.request
    return add_prompt_logprobs(_body(prepared, meta, final, tokenizer), final, tokenizer, chat=req.chat,
                               echo_top=req.echo_logprobs, vllm_top=req.prompt_logprobs)


def _body(prepared: Prepared, meta: ResponseMeta, final: RequestOutput, tokenizer: Tokenizer) -> dict:
    req = prepared.request
    if req.chat:
        return chat_body(meta, final, tokenizer, prepared.tools, prepared.reasoning)
    if req.best_of is None:
        return completion_body(meta, final, tokenizer, req.echo_text(tokenizer))
    best = best_of_outputs(final, req.sampling.params.n, keep_logprobs=req.sampling.params.logprobs is not None)
    body = completion_body(meta, best, tokenizer, req.echo_text(tokenizer))
    body["usage"] = output_usage(final)  # every sample generated counts
    return body


def placement_headers(prepared: Prepared, out: RequestOutput) -> dict[str, str]:
    """Where the request ran and why: its quadrant and the placement decision with its cost estimates."""
    return {"X-Quadrant": prepared.quadrant.value, "X-Placement": out.placement}


def batch_headers(parts: list[Prepared], outs: list[RequestOutput | None]) -> dict[str, str]:
    """A prompt list's quadrants, and the placements known so far, in prompt order, joined with ' | '."""
    return {"X-Quadrant": ",".join(p.quadrant.value for p in parts),
            "X-Placement": " | ".join(o.placement for o in outs if o is not None)}


def chunk_builder(ctx: ServerContext, prepared: Prepared, meta: ResponseMeta) -> ChunkBuilder:
    req = prepared.request
    return ChunkBuilder(meta, ctx.llm.tokenizer, chat=req.chat, wants_logprobs=req.sampling.params.logprobs is not None,
                        include_usage=req.include_usage, tools=prepared.tools, reasoning=prepared.reasoning,
                        echo=None if req.chat else req.echo_text(ctx.llm.tokenizer), echo_logprobs=req.echo_logprobs)


async def stream_response(request: web.Request, ctx: ServerContext, parts: list[Prepared], group: TrackerGroup,
                          meta: ResponseMeta) -> web.StreamResponse:
    if len(parts) > 1:
        return await _stream_list(request, ctx, parts, group, meta)
    prepared, tracker = parts[0], group.trackers[0]
    builder = chunk_builder(ctx, prepared, meta)
    async with aclosing(engine_outputs(ctx, prepared, tracker)) as outputs:
        first = await anext(outputs)  # before the headers, so that a refusal still gets its status code
        response = web.StreamResponse(headers=SSE_HEADERS | placement_headers(prepared, first))
        await response.prepare(request)
        await _pump(ctx, response, builder, first, outputs, tracker)
    return response


async def _stream_list(request: web.Request, ctx: ServerContext, parts: list[Prepared], group: TrackerGroup,
                       meta: ResponseMeta) -> web.StreamResponse:
    """A completion's prompt list as one stream: each prompt's chunks as its outputs arrive, their choices
    renumbered (prompt i, sample j -> index i * n + j), and one usage chunk summed over the prompts."""
    builders = [chunk_builder(ctx, p, meta) for p in parts]
    async with aclosing(MergedOutputs(ctx, parts, group.trackers)) as outputs:
        first = await anext(outputs)  # before the headers, so that a refusal still gets its status code
        firsts: list[RequestOutput | None] = [None] * len(parts)
        firsts[first[0]] = first[1]
        response = web.StreamResponse(headers=SSE_HEADERS | batch_headers(parts, firsts))
        await response.prepare(request)
        group.streamed()
        async with _stream_failures(ctx, response, group, meta.id):
            index, out = first
            while True:
                chunks = builders[index].chunks(out)
                for chunk in chunks:
                    _offset(chunk["choices"], index, parts)
                await response.write(encode_events(_traced(chunks, out)))
                group.trackers[index].written(out, time.monotonic())
                try:
                    index, out = await anext(outputs)
                except StopAsyncIteration:
                    break
            closing = []
            if parts[0].request.include_usage:
                totals = summed_usage([output_usage(t.last) for t in group.trackers])
                closing = [usage_chunk(meta, False, totals)]
            await response.write(encode_events(closing) + DONE)
            group.outcome = "ok"
    return response


async def _pump(ctx: ServerContext, response: web.StreamResponse, builder: ChunkBuilder, first: RequestOutput,
                outputs: AsyncIterator[RequestOutput], tracker: RequestTracker) -> None:
    """Writes the stream; every failure after the headers ends it with an error event instead of a status."""
    tracker.streamed = True
    async with _stream_failures(ctx, response, tracker, tracker.request_id):
        opening = builder.opening(len(first.outputs))
        await response.write(encode_events(opening + _traced(builder.chunks(first), first)))
        tracker.written(first, time.monotonic())
        async for out in outputs:
            await response.write(encode_events(_traced(builder.chunks(out), out)))
            tracker.written(out, time.monotonic())
        await response.write(encode_events(builder.closing(tracker.last)) + DONE)
        tracker.outcome = "ok"


@asynccontextmanager
async def _stream_failures(ctx: ServerContext, response: web.StreamResponse, tracker: RequestTracker | TrackerGroup,
                           request_id: str) -> AsyncIterator[None]:
    """A failure once the headers are out ends the stream with an error event (the status is sent already);
    a client that left ends it quietly (leaving aclosing() then aborts its requests in the engine)."""
    try:
        yield
    except ConnectionError:
        tracker.outcome = "client_disconnected"
    except ApiError as err:
        await _end_with_error(response, tracker, err, "aborted")
    except Exception:
        ctx.log.exception("stream failed")
        internal = ApiError(500, f"internal error while streaming (request {request_id})", None, "internal_error")
        await _end_with_error(response, tracker, internal, "error")


def _traced(chunks: list[dict], out: RequestOutput) -> list[dict]:
    """With token tracing, each chunk carries its output's stamps and the time it is handed to the socket."""
    if out.trace:
        stamps = [*out.trace, time.monotonic()]
        for chunk in chunks:
            chunk["phase_serve_trace"] = stamps
    return chunks


async def _end_with_error(response: web.StreamResponse, tracker: RequestTracker | TrackerGroup, err: ApiError,
                          outcome: str) -> None:
    tracker.outcome = outcome
    try:
        await response.write(sse_event(err.body()) + DONE)
    except ConnectionError:
        tracker.outcome = "client_disconnected"


# ---------------------------------------------------------------------------------------- the handler

async def handle_generation(request: web.Request, ctx: ServerContext, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    ctx.admission.check_open()
    body = parse_json_body(await read_body(request, ctx.settings.max_body_bytes))
    parse = parse_chat if chat else parse_completion
    requests = parse(body, ctx.limits.name, ctx.defaults).per_prompt()
    if len(requests) > ctx.settings.max_queue:
        raise bad_request(f"'prompt' holds {len(requests)} prompts; this server runs at most {ctx.settings.max_queue} "
                          "requests at once (--max-queue), so send them in smaller lists.", "prompt")
    parts = [await prepare(r, ctx.front_door, ctx.limits, ctx.settings.quadrants, ctx.treatment)
             for r in requests]  # every prompt is checked before any one runs
    ids = [request[REQUEST_ID]] if len(parts) == 1 else [f"{request[REQUEST_ID]}-{i}" for i in range(len(parts))]
    group = TrackerGroup([RequestTracker(rid, arrival, len(p.token_ids), p.quadrant) for rid, p in zip(ids, parts)])
    request[TRACKER] = group
    meta = ResponseMeta(request[REQUEST_ID], int(time.time()), ctx.limits.name)
    with ExitStack() as slots:
        for rid in ids:  # each prompt is an engine request and takes a slot; a 429 releases those taken
            slots.enter_context(ctx.admission.slot(rid))
        try:
            if requests[0].stream:
                return await stream_response(request, ctx, parts, group, meta)
            return await whole_response(ctx, parts, group, meta)
        finally:
            now = time.monotonic()
            for tracker in group.trackers:
                ctx.metrics.record(tracker.record(now))
