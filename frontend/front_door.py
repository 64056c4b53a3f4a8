"""One model's front door: a request (text, token ids, or a chat with tools) -> what the engine runs.

The HTTP handlers, `LLM` and `AsyncLLM` all come through here, so a request is rendered, tokenised and
constrained one way whichever of them sent it. The constraint of a forced tool call is built, not compiled:
the engine compiles it where it runs and refuses it there (engine.core.constraints).
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from engine.core.outputs import RequestOutput
from engine.model.loader import ModelSource
from engine.model.tokenizer import Tokenizer
from engine.sampling.sampling_params import SamplingParams
from frontend.chat import ChatTemplateError, render_chat
from frontend.output import ReasoningOutput, ToolCallOutput, read_chat_output
from engine.sampling.thinking_budget import INSIDE
from frontend.reasoning import CLOSE, OPEN, ReasoningParser, Start, choose_parser, special_tags, think_first
from frontend.tool_format import ToolFormat, choose_format
from frontend.tool_grammar import forced_guide
from frontend.tool_parsers import PARSERS, ToolParser, marks_special_tokens
from frontend.tools import Tool, ToolChoice, parse_tool_choice, parse_tools

OFFLOAD_CHARS = 16_384  # longer texts are tokenised on a worker thread so the event loop stays responsive
Prompt = Union[str, list[int]]
Messages = list[dict[str, Any]]
TemplateKwargs = Mapping[str, Any]


@dataclass(frozen=True)
class ChatTools:
    """A chat's tools, tool_choice and parallel_tool_calls, validated."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice("none")
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Sequence[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True) -> ChatTools:
        """OpenAI's shapes; ToolError (a ValueError naming the field) for malformed tools or a choice naming no
        tool."""
        parsed = parse_tools(None if tools is None else list(tools))
        return cls(parsed, parse_tool_choice(tool_choice, parsed), parallel)

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for calls: tools are offered and tool_choice is not none."""
        return bool(self.tools) and self.choice.mode != "none"


NO_TOOLS = ChatTools()


class ThinkingBudgetError(ValueError):
    """A thinking budget that cannot be enforced for the served model."""


@dataclass(frozen=True)
class EngineInput:
    """What the engine runs for one prompt, and how its output is read."""

    prompt: str | None  # the text the tokens came from; None for token ids given as such
    token_ids: list[int]
    params: SamplingParams
    tools: ToolCallOutput | None = None  # None: plain text, no tool calls read
    reasoning: ReasoningOutput | None = None  # None: no reasoning split off

    def read_output(self, out: RequestOutput) -> RequestOutput:
        """`out` with each sample's reasoning, content and tool calls read out of its text (chat)."""
        return read_chat_output(out, self.tools, self.reasoning)


class FrontDoor:
    """Rendering, tokenising and constraining for one model, tool-call format and reasoning parser."""

    def __init__(self, tokenizer: Tokenizer, tool_format: ToolFormat,
                 reasoning: ReasoningParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.reasoning = reasoning

    @classmethod
    def for_source(cls, source: ModelSource, tool_call_parser: str = "auto",
                   reasoning_parser: str = "auto") -> FrontDoor:
        """`tool_call_parser`: auto (from the chat template, then the architecture), hermes, llama3 or mistral.
        `reasoning_parser`: auto (from the chat template and the vocabulary), deepseek_r1, qwen3 or none."""
        tokenizer = source.tokenizer
        fmt = choose_format(tool_call_parser, tokenizer.chat_template, getattr(source.config, "architecture", None))
        return cls(tokenizer, fmt, choose_parser(reasoning_parser, tokenizer.chat_template, _tag_tokens(tokenizer),
                                                 _opening(tokenizer)))

    @property
    def reasoning_name(self) -> str:
        return "none" if self.reasoning is None else self.reasoning.name

    @property
    def parser(self) -> ToolParser:
        return PARSERS[self.tool_format]()

    # ------------------------------------------------------------------------------------ prompts

    def render_chat(self, messages: Messages, tools: ChatTools = NO_TOOLS, add_generation_prompt: bool = True,
                    template_kwargs: TemplateKwargs | None = None) -> str:
        """ChatTemplateError (a ValueError) when the model's template refuses the messages. `template_kwargs`:
        extra variables for the template (enable_thinking, ...)."""
        return render_chat(self.tokenizer, messages, tools.tools, self.tool_format, add_generation_prompt,
                           template_kwargs)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool) -> list[int]:
        """`encode`, on a worker thread for a long text."""
        if len(text) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    # ------------------------------------------------------------------------------------ params

    def with_tools(self, params: SamplingParams, tools: ChatTools) -> tuple[SamplingParams, ToolCallOutput | None]:
        """`params` with the constraint of a forced call and special tokens kept where the format's marker is
        one, and the reader of the calls; `params` and None when the output is not read for calls."""
        if not tools.reads_calls:
            return params, None
        parser = self.parser
        if tools.choice.forced:
            params = dataclasses.replace(params, guide=forced_guide(self.tool_format, tools.tools, tools.choice,
                                                                    tools.parallel))
        if marks_special_tokens(parser, self.tokenizer):
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params, ToolCallOutput(parser, tools.parallel)

    def with_reasoning(self, params: SamplingParams, prompt: str | None, budget: int | None = None
                       ) -> tuple[SamplingParams, ReasoningOutput | None]:
        """`params` with its constraint moved past the thinking, special tokens kept where a think tag is one
        and the thinking held to `budget` tokens, and the reader of the reasoning; `params` and None for a model
        that does not think. `prompt`: the rendered chat, which says whether the output starts inside the think
        block. ThinkingBudgetError where a budget cannot be enforced."""
        if self.reasoning is None:
            if budget is not None:
                raise ThinkingBudgetError("the served model does not think (it has no reasoning parser), so it "
                                          "has no thinking to budget.")
            return params, None
        reading = ReasoningOutput(self.reasoning, self.reasoning.start(prompt))
        if params.guide is not None:
            params = dataclasses.replace(params, guide=think_first(params.guide, self.reasoning, reading.start))
        if special_tags(self.reasoning, self.tokenizer.all_special_ids, lambda t: self.encode(t, False)):
            params = dataclasses.replace(params, skip_special_tokens=False)
        if budget is not None and reading.start is not Start.ANSWER:
            params = dataclasses.replace(params, thinking_budget=self._budget(budget, reading.start))
        return params, reading

    def _budget(self, tokens: int, start: Start) -> tuple[int, int, int]:
        """The engine's thinking budget: (tokens, the open tag's id or -1 where the output starts inside the
        block, the close tag's id)."""
        assert self.reasoning is not None
        ids = [self.encode(tag, False) for tag in (self.reasoning.open, self.reasoning.close)]
        if any(len(i) != 1 for i in ids):
            raise ThinkingBudgetError(f"a thinking budget needs {self.reasoning.open} and {self.reasoning.close} "
                                      "to be single tokens of the vocabulary, and this model spells them in "
                                      "several.")
        inside = start is Start.THINKING or self.reasoning.implicit_open
        return tokens, INSIDE if inside else ids[0][0], ids[1][0]

    # ------------------------------------------------------------------------------------ whole requests

    def prompt(self, prompt: Prompt, params: SamplingParams | None = None) -> EngineInput:
        """A text (tokenised with the model's special tokens) or token ids."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            return EngineInput(prompt, self.encode(prompt, True), params)
        return EngineInput(None, list(prompt), params)

    def embedding(self, prompt: Prompt, pooling: str) -> EngineInput:
        """A text (tokenised with the model's special tokens) or token ids to embed: a prefill whose final hidden
        states are pooled (`pooling`: last or mean, EngineConfig.pooling); the one token it samples is dropped."""
        return self.prompt(prompt, SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling))

    def chat(self, messages: Messages, params: SamplingParams | None = None, tools: ChatTools = NO_TOOLS,
             add_generation_prompt: bool = True, template_kwargs: TemplateKwargs | None = None) -> EngineInput:
        text = self.render_chat(messages, tools, add_generation_prompt, template_kwargs)
        params, reader = self.with_tools(params or SamplingParams(), tools)
        params, reasoning = self.with_reasoning(params, text)
        return EngineInput(text, self.encode(text, False), params, reader, reasoning)


def _tag_tokens(tokenizer: Tokenizer) -> bool:
    """Whether both think tags are single tokens of the vocabulary."""
    return all(len(tokenizer.encode(tag, False)) == 1 for tag in (OPEN, CLOSE))


def _opening(tokenizer: Tokenizer) -> str | None:
    """The prompt of a one-message chat (its end says whether the template opens a think block); None where the
    template refuses it or there is none."""
    try:
        return render_chat(tokenizer, [{"role": "user", "content": "Hi"}], (), ToolFormat.HERMES, True)
    except ChatTemplateError:
        return None
