"""`AsyncLLM`: streaming generation over an EngineClient, the engine in this process or the actor router."""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import fields
from typing import AsyncIterator, Sequence

from actors.ray_options import RayOptions
from actors.start_watch import DEFAULT_START_SILENCE
from actors.supervisor import SupervisorSettings
from client.in_process import InProcessClient
from client.prompts import engine_config
from engine.core.builder import build_engine_core
from engine.core.client_protocol import EngineClient
from engine.config import ConfigError, EngineConfig
from engine.core.engine_core import EngineRequest, RequestError
from engine.core.engine_thread import build_off_thread
from engine.model.loader import check_model, resolve_dtype, resolve_model
from engine.core.output_processor import OutputProcessor
from engine.core.stream_interval import StreamInterval
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.core.step import SequenceUpdate
from engine.core.stats import EngineStats
from engine.core.treatment import Treatment
from frontend.front_door import ChatTools, EngineInput, FrontDoor, Messages, Prompt
from router.elastic_settings import ElasticSettings
from router.layout import ActorLayout, actor_specs, check_local_memory
from router.placement import PlacementMode, PlacementPolicy
from router.router import ActorRouter, RouterSettings


class RequestAbortedError(RuntimeError):
    """The request was aborted by `AsyncLLM.abort` (the server does so at the end of its grace period)."""


class AsyncLLM:
    """Streaming generation: `async for out in AsyncLLM().generate(prompt, params)` yields outputs whose
    `outputs[i].delta_text` is the new text. Cancelling the iteration aborts the request.

    By default the engine runs in this process. With `decode_actors` (and optionally `prefill_actors`) it
    runs in actor subprocesses behind the router instead, exactly as `cli.py serve` does (`draft_actors` moves
    the draft model of speculative="draft" out of the decode actors into processes of its own); call
    `await start()` first (or let the first request do it) and `await aclose()` at the end.

    `stream_interval` (tokens, or "auto"): how many new tokens an output waits for (StreamInterval). Outputs
    that pile up before the consumer reads them are merged into one, whatever the interval. `trace_tokens`:
    each output's `trace` holds when its tokens left the step, were sent, received and detokenised.
    `capacity_timeout`: with actors, how long a request waits for a decode actor to come (back) up before it
    fails with engine.core.client_protocol.NoCapacityError. `max_migrations`: how many times one stream may
    be resumed on another decode actor before it fails. `ray`: place the actors on a Ray cluster (actors.ray_options).
    `start_silence`: seconds a starting actor may go without reporting progress before it is given up (its start
    has no limit on the total: actors/start_watch.py). `elastic`: the planner's targets, whether it changes actors
    between prefill and decode, and whether a prefill actor takes over a lost decode role (router/elastic.py). With actors, what they will hold is checked against this
    host's memory before any starts (InsufficientMemoryError, a ConfigError); in process, before the weights load.
    """

    def __init__(self, model: str | None = None, dtype: str | None = None, *, decode_actors: int = 0,
                 prefill_actors: int = 0, devices: Sequence[str] = (), disagg: PlacementMode = "auto",
                 listen_workers: str | None = None, draft_actors: int = 0, stream_interval: int | str = 1,
                 trace_tokens: bool = False, capacity_timeout: float = 30.0, max_migrations: int = 3,
                 ray: RayOptions | None = None, start_silence: float = DEFAULT_START_SILENCE,
                 elastic: ElasticSettings = ElasticSettings(), **engine_options) -> None:
        self.stream_interval = StreamInterval.parse(stream_interval)
        self.trace_tokens = trace_tokens
        self.capacity_timeout, self.max_migrations = capacity_timeout, max_migrations
        self.supervisor_settings = SupervisorSettings(start_silence=start_silence)
        self.config = engine_config(model, dtype, engine_options)
        self.elastic = elastic
        self.layout = ActorLayout(prefill_actors, decode_actors, tuple(devices), disagg, listen_workers, draft_actors,
                                  trace_tokens, ray, elastic.on)
        if draft_actors and self.config.speculative != "draft":
            raise ConfigError("draft_actors needs speculative='draft' (and a draft_model)")
        self.engine = None if self.layout.uses_actors else build_off_thread(lambda: build_engine_core(self.config))
        self.source = self.engine.source if self.engine else _checked_source(self.config)
        if self.engine is None:  # before any actor starts; an engine in this process checked itself
            check_local_memory(actor_specs(self.layout, _actor_engine_options(self.config, elastic)), self.source,
                               elastic.on)
        self.tokenizer = self.source.tokenizer
        self.front_door = FrontDoor.for_source(self.source)
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, _OutputStream] = {}
        self._client: EngineClient | None = None
        self._ids = itertools.count()
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._last_updates = 0.0  # time.monotonic() of the last batch of updates

    async def start(self) -> None:
        """Bind to the running loop (spawning the actors, if any). Idempotent and safe to call concurrently."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        async with self._starting[1]:
            await self._bind(loop)

    async def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._client is not None and self._client.loop is not loop:
            if not self._client.loop.is_closed():
                raise RuntimeError("this AsyncLLM is serving another running event loop")
            self.shutdown()
        if self._client is None:
            self._client = await self._make_client(loop)

    async def _make_client(self, loop: asyncio.AbstractEventLoop) -> EngineClient:
        if not self.layout.uses_actors:
            return InProcessClient(self.engine, loop, self._on_updates, self._on_error)
        specs = actor_specs(self.layout, _actor_engine_options(self.config, self.elastic))
        settings = RouterSettings(PlacementPolicy(self.layout.disagg), park_timeout=self.capacity_timeout,
                                  max_migrations=self.max_migrations, elastic=self.elastic,
                                  share_kv=self.layout.hands_off_kv)
        router = ActorRouter(specs, self._on_updates, self._on_error, settings, self.supervisor_settings,
                             ray=self.layout.ray)
        try:
            await router.start(self.layout.listen_address())
        except BaseException:
            await router.close()  # the actors that did start, and the socket directory
            raise
        return router

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, treatment: Treatment = Treatment()) -> AsyncIterator[RequestOutput]:
        """`treatment`: per-request speculation and KV compression (the server sets it from the quadrant)."""
        async for out in self._stream(self.front_door.prompt(prompt, params), request_id, priority, treatment):
            yield out

    async def embed(self, prompt: Prompt, request_id: str | None = None, priority: int = 0,
                    treatment: Treatment = Treatment()) -> EmbeddingOutput:
        """The prompt's (text or token ids) L2-normalised embedding: its final hidden states pooled as the
        engine's `pooling` option says. It runs as a prefill on the engine (or a decode actor) that generates."""
        final = None
        async for final in self._stream(self.front_door.embedding(prompt, self.config.pooling), request_id,
                                        priority, treatment):
            pass
        return EmbeddingOutput.of(final)

    async def chat(self, messages: Messages, params: SamplingParams | None = None, request_id: str | None = None,
                   *, tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                   parallel_tool_calls: bool = True, tool_call_parser: str = "auto",
                   chat_template_kwargs: dict | None = None) -> AsyncIterator[RequestOutput]:
        """`tools` and `chat_template_kwargs` as LLM.chat takes them: the outputs stream the model's text, and
        the last one's samples hold the `tool_calls`, `content` and `reasoning_content` read out of it.
        ToolError (a ValueError naming the field) for bad tools."""
        door = self.front_door if tool_call_parser == "auto" else FrontDoor.for_source(self.source, tool_call_parser)
        given = door.chat(messages, params, ChatTools.parse(tools, tool_choice, parallel_tool_calls),
                          template_kwargs=chat_template_kwargs)
        async for out in self._stream(given, request_id, 0):
            yield given.read_output(out) if out.finished else out

    async def _stream(self, given: EngineInput, request_id: str | None, priority: int,
                      treatment: Treatment = Treatment()) -> AsyncIterator[RequestOutput]:
        await self.start()
        client = self._client
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        token_ids = given.params.truncated_prompt(given.token_ids, self.max_model_len)
        self._check_length(token_ids)
        stream = self._streams[rid] = _OutputStream()
        arrival = time.monotonic()
        self.processor.add(rid, given.prompt, token_ids, given.params, arrival)
        finished = False
        try:
            placement = await client.add(EngineRequest(rid, token_ids, given.params, priority, arrival, treatment))
            while not finished:
                item = await stream.next()
                if isinstance(item, Exception):
                    raise item
                placement = client.placement_of(rid) or placement
                if placement is not None:
                    item.path, item.placement = placement.path, placement.header()
                    item.moves = placement.moves
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.processor.abort(rid)
                client.abort(rid)

    def _check_length(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; this model's context is "
                               f"{self.max_model_len} tokens including at least one output token", "prompt")

    def abort(self, request_id: str) -> None:
        """Abort a request: its engine work stops, and its stream ends at once with RequestAbortedError
        (outputs not yet read are dropped)."""
        if self._client is not None:
            self._client.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            self.processor.abort(request_id)
            stream.fail_now(RequestAbortedError(f"request {request_id} was aborted"))

    def begin_shutdown(self) -> None:
        """The server is draining: actors that exit or ask to leave now are neither replaced nor drained (a
        no-op in process)."""
        if self._client is not None:
            self._client.begin_shutdown()

    @property
    def model_name(self) -> str:
        return self.source.name

    @property
    def dtype_name(self) -> str:
        """The serving dtype, resolved as the engine (or its actors) resolve it."""
        if self.engine is not None:
            return str(self.engine.dtype).removeprefix("torch.")
        device = self.layout.devices[0] if self.layout.devices else "cpu"
        return str(resolve_dtype(self.config.dtype, device)).removeprefix("torch.")

    @property
    def max_model_len(self) -> int:
        cfg = self.source.config
        return min(self.config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)

    def stats(self) -> EngineStats:
        """A snapshot of the queues and KV pool(s), read without stopping any step."""
        if self._client is None:
            return self.engine.stats() if self.engine else EngineStats()
        return self._client.stats()

    def can_serve(self) -> bool:
        return self._client is not None and self._client.can_serve()

    def actors(self) -> list[dict]:
        return [] if self._client is None else self._client.actors()

    def backend(self) -> dict | None:
        """Which backend and kernels the in-process engine runs (None with actors: each actor's is in `actors`)."""
        return None if self.engine is None else self.engine.runner.backend.describe()

    def calibration(self) -> dict:
        """Per-actor fitted costs (empty in-process: placement needs no costs there)."""
        return {} if self._client is None else self._client.calibration()

    def counters(self) -> dict[str, int]:
        """Cumulative router counters (KV hand-offs, stream migrations, role changes); empty in-process."""
        return {} if self._client is None else self._client.counters()

    def layout_status(self) -> dict:
        """The actors' layout, the elastic planner's last decision and the role changes (empty in-process)."""
        return {} if self._client is None else self._client.layout_status()

    async def drain(self, actor_id: str) -> int:
        """Move a prefill or decode actor's requests elsewhere, then restart it; the number moved. KeyError:
        no such actor; ValueError: it cannot be drained now."""
        if self._client is None:
            raise KeyError(actor_id)
        return await self._client.drain(actor_id)

    def _on_updates(self, updates: list[SequenceUpdate]) -> None:
        received = self._client.trace() if self.trace_tokens else ()
        interval = self.stream_interval
        now = time.monotonic()
        period, self._last_updates = now - self._last_updates, now  # about a step, while steps run back to back
        outputs, to_abort = self.processor.process(updates, interval.tokens(len(self._streams), period),
                                                   interval.max_wait)
        if received:
            stamps = (*received, time.monotonic())
            for out in outputs:
                out.trace = stamps
        for rid, index in to_abort:
            self._client.abort(rid, index)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _on_error(self, request_id: str, exc: Exception) -> None:
        self.processor.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def shutdown(self) -> None:
        """Stop an in-process engine's step thread and abort whatever is still queued or running."""
        if self.layout.uses_actors:
            raise RuntimeError("an AsyncLLM with actors is closed with `await aclose()`")
        if self._client is not None:
            self._client.stop()  # an InProcessClient: without actors there is no other kind
            self._client = None
        self.engine.abort_all()
        self._forget_streams()

    async def aclose(self) -> None:
        """Stop the engine (in-process or actors); every request still in flight ends with an error."""
        if self._client is None:
            return
        await self._client.close()
        self._client = None
        if self.engine is not None:
            self.engine.abort_all()
        self._forget_streams()

    def _forget_streams(self) -> None:
        for stream in self._streams.values():
            stream.put(RuntimeError("the engine was shut down"))
        self.processor.requests.clear()
        self._streams.clear()



class _OutputStream:
    """One request's outputs as they arrive, for its one reader."""

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput | Exception] = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        self._items.append(item)
        self._ready.set()

    def fail_now(self, exc: Exception) -> None:
        """End the stream with `exc` before anything still queued."""
        self._items.clear()
        self.put(exc)

    async def next(self) -> RequestOutput | Exception:
        """The next item, with the outputs queued behind it merged in (an error waits for the next call)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        while isinstance(item, RequestOutput) and not item.finished and self._items \
                and isinstance(self._items[0], RequestOutput):
            item = self._items.popleft().after(item)
        return item


def _checked_source(config: EngineConfig):
    """The model (and draft model) checked here, before any actor spawns: a model that cannot load fails with
    one ModelLoadError sentence instead of an actor's traceback."""
    source = resolve_model(config.model)
    check_model(source)
    if config.speculative == "draft" and config.draft_model and not config.draft_model.startswith("self:"):
        check_model(resolve_model(config.draft_model))
    return source


def _actor_engine_options(config: EngineConfig, elastic: ElasticSettings) -> dict:
    """The actors' engine options: the config's, each step carrying decodes cut to --slo-itl unless the config
    names its own target."""
    options = {f.name: getattr(config, f.name) for f in fields(config)}
    if options["itl_target"] is None:
        options["itl_target"] = elastic.slo_itl
    return options
