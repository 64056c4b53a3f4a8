"""The embedded client: `LLM` (blocking, batch) and `AsyncLLM` (streaming), modelled on vLLM's API."""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence, Union

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineRequest, EngineStats
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import SequenceUpdate
from engine.tokenizer import Tokenizer

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


class InProcessEngineClient:
    """Runs an EngineCore on a worker thread; updates are delivered on the asyncio loop that started it.

    The actor client (a subprocess over msgpack) has the same three calls: add, abort, shutdown.
    """

    def __init__(self, engine: EngineCore, loop: asyncio.AbstractEventLoop, on_updates, on_error) -> None:
        self.engine = engine
        self.loop = loop
        self._on_updates = on_updates
        self._on_error = on_error
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def add(self, request: EngineRequest) -> None:
        self._commands.put(("add", request))

    def abort(self, request_id: str, sample_index: int | None = None) -> None:
        self._commands.put(("abort", (request_id, sample_index)))

    def shutdown(self) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self._deliver(self._step())

    def _step(self) -> list[SequenceUpdate]:
        try:
            return self.engine.step()
        except Exception as exc:  # a bug in a step must not leave callers waiting forever
            ids = list(self.engine.scheduler.by_request)
            for rid in ids:
                self.engine.abort_request(rid)
                self.loop.call_soon_threadsafe(self._on_error, rid, exc)
            return []

    def _drain_commands(self, block: bool) -> None:
        try:
            kind, arg = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(kind, arg)
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg) -> None:
        if kind == "stop":
            self._stopped = True
        elif kind == "abort":
            self._deliver(self.engine.abort_request(*arg))
        else:
            try:
                self.engine.add_request(arg)
            except ValueError as exc:
                self.loop.call_soon_threadsafe(self._on_error, arg.request_id, exc)

    def _deliver(self, updates: list[SequenceUpdate]) -> None:
        if updates and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._on_updates, updates)


class AsyncLLM:
    """Streaming generation: `async for out in AsyncLLM().generate(prompt, params)` yields outputs whose
    `outputs[i].delta_text` is the new text. Cancelling the iteration aborts the request."""

    def __init__(self, model: str | None = None, dtype: str | None = None, **engine_options) -> None:
        self.config = _engine_config(model, dtype, engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.source.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue] = {}
        self._client: InProcessEngineClient | None = None
        self._ids = itertools.count()

    def _ensure_client(self) -> InProcessEngineClient:
        """Bind to the running loop on first use; a closed previous loop (e.g. asyncio.run twice) is replaced."""
        loop = asyncio.get_running_loop()
        if self._client is not None and self._client.loop is not loop:
            if not self._client.loop.is_closed():
                raise RuntimeError("this AsyncLLM is serving another running event loop")
            self.shutdown()
        if self._client is None:
            self._client = InProcessEngineClient(self.engine, loop, self._on_updates, self._on_error)
        return self._client

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        async for out in self._stream(_prepare(self.tokenizer, prompt), params, request_id, priority):
            yield out

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        async for out in self._stream(_chat_prompt(self.tokenizer, messages), params, request_id, 0):
            yield out

    async def _stream(self, prep: _Prepared, params: SamplingParams | None, request_id: str | None,
                      priority: int) -> AsyncIterator[RequestOutput]:
        client = self._ensure_client()
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream = self._streams[rid] = asyncio.Queue()
        arrival = time.monotonic()
        self.processor.add(rid, prep.prompt, prep.token_ids, params, arrival)
        client.add(EngineRequest(rid, prep.token_ids, params, priority, arrival))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.processor.abort(rid)
                client.abort(rid)

    def abort(self, request_id: str) -> None:
        if self._client is not None:
            self._client.abort(request_id)

    @property
    def model_name(self) -> str:
        return self.engine.source.name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """A snapshot of the engine's queues and KV pool (read without stopping the step thread)."""
        return self.engine.stats()

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
        """Stop the step thread and abort whatever is still queued or running."""
        if self._client is not None:
            self._client.shutdown()
            self._client = None
        for request_id in list(self.engine.scheduler.by_request):
            self.engine.abort_request(request_id)
        self.processor.requests.clear()
        self._streams.clear()
