"""The embedded client: `LLM` (blocking, batch) and `AsyncLLM` (streaming), modelled on vLLM's API."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence, Union

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineRequest, EngineStats
from engine.engine_thread import EngineThread
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


class AsyncLLM:
    """Streaming generation: `async for out in AsyncLLM().generate(prompt, params)` yields outputs whose
    `outputs[i].delta_text` is the new text. Cancelling the iteration aborts the request."""

    def __init__(self, model: str | None = None, dtype: str | None = None, **engine_options) -> None:
        self.config = _engine_config(model, dtype, engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.source.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, asyncio.Queue] = {}
        self._client: EngineThread | None = None
        self._ids = itertools.count()

    def _ensure_client(self) -> EngineThread:
        """Bind to the running loop on first use; a closed previous loop (e.g. asyncio.run twice) is replaced."""
        loop = asyncio.get_running_loop()
        if self._client is not None and self._client.loop is not loop:
            if not self._client.loop.is_closed():
                raise RuntimeError("this AsyncLLM is serving another running event loop")
            self.shutdown()
        if self._client is None:
            self._client = EngineThread(self.engine, loop, self._on_updates, self._on_step_error)
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
        request = EngineRequest(rid, prep.token_ids, params, priority, arrival)
        finished = False
        try:
            await client.submit(lambda engine: engine.add_request(request))
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
                client.post(lambda engine: engine.abort_request(rid))

    def abort(self, request_id: str) -> None:
        if self._client is not None:
            self._client.post(lambda engine: engine.abort_request(request_id))

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
            self._client.post(lambda engine, rid=rid, index=index: engine.abort_request(rid, index))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _on_step_error(self, exc: BaseException) -> None:
        """A step failed: every request in flight ends with the error (the engine aborts them all)."""
        self._client.post(lambda engine: engine.abort_all())
        for rid, stream in list(self._streams.items()):
            self.processor.abort(rid)
            stream.put_nowait(RuntimeError(f"engine step failed: {exc}"))

    def shutdown(self) -> None:
        """Stop the step thread and abort whatever is still queued or running."""
        if self._client is not None:
            self._client.shutdown()
            self._client = None
        self.engine.abort_all()
        self.processor.requests.clear()
        self._streams.clear()
