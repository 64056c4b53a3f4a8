"""`LLM`: blocking batch generation in this process, stepping the engine on the caller's thread."""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from client.prompts import engine_config
from engine.core.builder import build_engine_core
from engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS
from engine.core.engine_core import EngineRequest
from engine.core.output_processor import OutputProcessor
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.core.step import SequenceUpdate
from frontend.front_door import ChatTools, EngineInput, FrontDoor, Messages, Prompt


class LLM:
    """Blocking batch generation in this process: `LLM().generate(prompts, params)`."""

    def __init__(self, model: str | None = None, dtype: str | None = None, **engine_options) -> None:
        """engine_options: EngineConfig's fields; max_num_batched_tokens defaults to the offline profile's
        (engine.config.OFFLINE) here."""
        engine_options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = engine_config(model, dtype, engine_options)
        self.engine = build_engine_core(self.config)
        self.tokenizer = self.engine.source.tokenizer
        self.front_door = FrontDoor.for_source(self.engine.source)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A list of ints is one tokenised prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.front_door.prompt(p, sp) for p, sp in zip(prompts, _per_prompt(params, len(prompts)))])

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """One L2-normalised vector per prompt (text or token ids), in order: the prompt's final hidden states
        pooled as the engine's `pooling` option says (the last token's, or the mean of every token's). Each
        prompt runs as a prefill beside whatever else the engine runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs = self._run([self.front_door.embedding(p, self.config.pooling) for p in prompts])
        return [EmbeddingOutput.of(out) for out in outputs]

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True, tool_call_parser: str = "auto",
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """With `tools` (OpenAI's shape), each sample's `tool_calls` and `content` hold what the model called
        and said; tool_choice "required" or `{"type": "function", "function": {"name": ...}}` forces a call
        whose arguments follow the function's schema. tool_call_parser: auto, hermes, llama3 or mistral. A
        model that thinks (`<think>`) has its thinking in each sample's `reasoning_content` and its answer in
        `content`. chat_template_kwargs: extra variables for the chat template (enable_thinking, ...)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        chat_tools = ChatTools.parse(tools, tool_choice, parallel_tool_calls)
        door = self.front_door if tool_call_parser == "auto" else FrontDoor.for_source(self.engine.source,
                                                                                       tool_call_parser)
        params_list = _per_prompt(params, len(conversations))
        inputs = [door.chat(m, p, chat_tools, template_kwargs=chat_template_kwargs)
                  for m, p in zip(conversations, params_list)]
        outputs = self._run(inputs)
        return [i.read_output(out) for i, out in zip(inputs, outputs)]

    def _run(self, inputs: list[EngineInput]) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        ids = [f"llm-{next(self._ids)}" for _ in inputs]
        for rid, given in zip(ids, inputs):
            token_ids = given.params.truncated_prompt(given.token_ids, self.engine.max_model_len)
            processor.add(rid, given.prompt, token_ids, given.params)
            request = EngineRequest(rid, token_ids, given.params, arrival_time=time.monotonic())
            self.engine.prepare_request(request)
            self.engine.add_request(request)
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


