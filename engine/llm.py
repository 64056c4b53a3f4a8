"""The embedded client: `LLM` (blocking, batch) and `AsyncLLM` (streaming), modelled on vLLM's API."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, fields
from typing import AsyncIterator, Sequence, Union

from engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, ConfigError, EngineConfig
from engine.engine_core import EngineCore, EngineRequest, EngineStats, RequestError
from engine.engine_thread import EngineThread
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SequenceUpdate
from engine.model.loader import resolve_dtype, resolve_model
from engine.tokenizer import Tokenizer
from engine.treatment import Treatment

Prompt = Union[str, list[int]]
Messages = list[dict[str, str]]


def _engine_config(model: str | None, dtype: str | None, options: dict) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype or "auto", **options)


@dataclass
class _Prepared:
    prompt: str | None
    token_ids: list[int]


def _prepare(tokenizer: Tokenizer, prompt: Prompt) -> _Prepared:
    if isinstance(prompt, str):
        return _Prepared(prompt, tokenizer.encode(prompt))
    return _Prepared(None, list(prompt))


def _chat_prompt(tokenizer: Tokenizer, messages: Messages) -> _Prepared:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return _Prepared(text, tokenizer.encode(text, add_special_tokens=False))


class LLM:
    """Blocking batch generation in this process: `LLM().generate(prompts, params)`."""

    def __init__(self, model: str | None = None, dtype: str | None = None, **engine_options) -> None:
        """engine_options: EngineConfig's fields; max_num_batched_tokens defaults to the offline profile's
        (engine.config.OFFLINE) here."""
        engine_options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = _engine_config(model, dtype, engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.source.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A list of ints is one tokenised prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([_prepare(self.tokenizer, p) for p in prompts], params)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([_chat_prompt(self.tokenizer, m) for m in conversations], params)

    def _run(self, prepared: list[_Prepared], params) -> list[RequestOutput]:
        params_list = _per_prompt(params, len(prepared))
        processor = OutputProcessor(self.tokenizer)
        ids = [f"llm-{next(self._ids)}" for _ in prepared]
        for rid, prep, p in zip(ids, prepared, params_list):
            processor.add(rid, prep.prompt, prep.token_ids, p)
            self.engine.add_request(EngineRequest(rid, prep.token_ids, p, arrival_time=time.monotonic()))
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            self._collect(processor, self.engine.step(), final)
        return [final[rid] for rid in ids]

    def _collect(self, processor: OutputProcessor, updates: list[SequenceUpdate],
                 final: dict[str, RequestOutput]) -> None:
        outputs, to_abort = processor.process(updates)
        for rid, index in to_abort:
            self.engine.abort_request(rid, index)
        final.update((o.request_id, o) for o in outputs if o.finished)


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return list(params)


class InProcessClient:
    """The engine in this process, stepping on a worker thread (the default for scripts and tests)."""

    def __init__(self, engine: EngineCore, loop: asyncio.AbstractEventLoop, on_updates, on_error) -> None:
        self.engine = engine
        self.loop = loop
        self._on_error = on_error
        self.thread = EngineThread(engine, loop, on_updates, self._on_step_error)

    async def add(self, request: EngineRequest) -> None:
        await self.thread.submit(lambda engine: engine.add_request(request))

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        self.thread.post(lambda engine: engine.abort_request(request_id, sample_index))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def can_serve(self) -> bool:
        return True

    def actors(self) -> list[dict]:
        return []

    def calibration(self) -> dict:
        return {}

    def placement_of(self, request_id: str) -> None:
        return None

    def _on_step_error(self, exc: BaseException) -> None:
        """A step failed: every request in flight ends with the error (the engine aborts them all)."""
        request_ids = list(self.engine.scheduler.by_request)
        self.thread.post(lambda engine: engine.abort_all())
        for rid in request_ids:
            self._on_error(rid, RuntimeError(f"engine step failed: {exc}"))

    def close(self) -> None:
        self.thread.shutdown()
        self.engine.abort_all()


class AsyncLLM:
    """Streaming generation: `async for out in AsyncLLM().generate(prompt, params)` yields outputs whose
    `outputs[i].delta_text` is the new text. Cancelling the iteration aborts the request.

    By default the engine runs in this process. With `decode_actors` (and optionally `prefill_actors`) it
    runs in actor subprocesses behind the router instead, exactly as `cli.py serve` does (`draft_actors` moves
    the draft model of speculative="draft" out of the decode actors into processes of its own); call
    `await start()` first (or let the first request do it) and `await aclose()` at the end.
    """

    def __init__(self, model: str | None = None, dtype: str | None = None, *, decode_actors: int = 0,
                 prefill_actors: int = 0, devices: Sequence[str] = (), disagg: str = "auto",
                 listen_workers: str | None = None, draft_actors: int = 0, **engine_options) -> None:
        self.config = _engine_config(model, dtype, engine_options)
        self.layout = ActorLayout(prefill_actors, decode_actors, tuple(devices), disagg, listen_workers, draft_actors)
        if draft_actors and self.config.speculative != "draft":
            raise ConfigError("draft_actors needs speculative='draft' (and a draft_model)")
        self.engine = None if self.layout.uses_actors else EngineCore(self.config)
        self.source = self.engine.source if self.engine else resolve_model(self.config.model)
        self.tokenizer = self.source.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue] = {}
        self._client = None
        self._ids = itertools.count()
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

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

    async def _make_client(self, loop: asyncio.AbstractEventLoop):
        if not self.layout.uses_actors:
            return InProcessClient(self.engine, loop, self._on_updates, self._on_error)
        from router.router import ActorRouter, RouterSettings, actor_specs
        from router.placement import PlacementPolicy

        specs = actor_specs(self.layout, _config_options(self.config))
        router = ActorRouter(specs, self._on_updates, self._on_error, RouterSettings(PlacementPolicy(self.layout.disagg)))
        await router.start(self.layout.listen_address())
        return router

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, treatment: Treatment = Treatment()) -> AsyncIterator[RequestOutput]:
        """`treatment`: per-request speculation and KV compression (the server sets it from the quadrant)."""
        async for out in self._stream(_prepare(self.tokenizer, prompt), params, request_id, priority, treatment):
            yield out

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self._stream(_chat_prompt(self.tokenizer, messages), params, request_id, 0):
            yield out

    async def _stream(self, prep: _Prepared, params: SamplingParams | None, request_id: str | None,
                      priority: int, treatment: Treatment = Treatment()) -> AsyncIterator[RequestOutput]:
        await self.start()
        client = self._client
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        self._check_length(prep.token_ids)
        stream = self._streams[rid] = asyncio.Queue()
        arrival = time.monotonic()
        self.processor.add(rid, prep.prompt, prep.token_ids, params, arrival)
        finished = False
        try:
            placement = await client.add(EngineRequest(rid, prep.token_ids, params, priority, arrival,
                                                       treatment.speculate, treatment.compress_first))
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                placement = client.placement_of(rid) or placement
                if placement is not None:
                    item.path, item.placement = placement.path, placement.header()
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
        if self._client is not None:
            self._client.abort(request_id)

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
            return self.engine.stats() if self.engine else EngineStats(0, 0, 0, 0, 0, 0, 0, 0)
        return self._client.stats()

    def can_serve(self) -> bool:
        return self._client is not None and self._client.can_serve()

    def actors(self) -> list[dict]:
        return [] if self._client is None else self._client.actors()

    def calibration(self) -> dict:
        """Per-actor fitted costs (empty in-process: placement needs no costs there)."""
        return {} if self._client is None else self._client.calibration()

    def _on_updates(self, updates: list[SequenceUpdate]) -> None:
        outputs, to_abort = self.processor.process(updates)
        for rid, index in to_abort:
            self._client.abort(rid, index)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _on_error(self, request_id: str, exc: Exception) -> None:
        self.processor.abort(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def shutdown(self) -> None:
        """Stop an in-process engine's step thread and abort whatever is still queued or running."""
        if self.layout.uses_actors:
            raise RuntimeError("an AsyncLLM with actors is closed with `await aclose()`")
        if self._client is not None:
            self._client.close()
            self._client = None
        self.engine.abort_all()
        self._forget_streams()

    async def aclose(self) -> None:
        """Stop the engine (in-process or actors); every request still in flight ends with an error."""
        if self._client is None:
            return
        if self.layout.uses_actors:
            await self._client.shutdown()
            self._client = None
            self._forget_streams()
        else:
            self.shutdown()

    def _forget_streams(self) -> None:
        for stream in self._streams.values():
            stream.put_nowait(RuntimeError("the engine was shut down"))
        self.processor.requests.clear()
        self._streams.clear()


@dataclass(frozen=True)
class ActorLayout:
    """How many actors of each role, on which devices (empty: CPU, cores split between them)."""

    prefill_actors: int = 0
    decode_actors: int = 0
    devices: tuple[str, ...] = ()
    disagg: str = "auto"
    listen_workers: str | None = None  # HOST:PORT where workers on other hosts join (secret: $PHASE_SERVE_SECRET)
    draft_actors: int = 0  # with speculative="draft": draft model processes (0: the draft runs in each decode actor)

    def __post_init__(self) -> None:
        if self.prefill_actors < 0 or self.decode_actors < 0 or self.draft_actors < 0:
            raise ValueError("actor counts must not be negative")
        if self.draft_actors and not self.decode_actors:
            raise ValueError("draft actors need at least one decode actor to draft for")
        if self.prefill_actors and not self.decode_actors and self.listen_workers is None:
            raise ValueError("prefill actors need a decode actor (or --listen-workers for remote ones) to hand "
                             "their KV to")

    @property
    def uses_actors(self) -> bool:
        return self.decode_actors > 0 or self.listen_workers is not None

    def listen_address(self) -> tuple[str, int, bytes] | None:
        if self.listen_workers is None:
            return None
        from transport import load_secret

        host, port = self.listen_workers.rsplit(":", 1)
        return host, int(port), load_secret()


def _config_options(config: EngineConfig) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(config)}
