"""Prompts as the embedded clients take them: text, token ids or chat messages, tokenised once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence, Union

from engine.config import EngineConfig
from engine.model.loader import ModelSource
from engine.core.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams
from engine.model.tokenizer import Tokenizer
from engine.tool_calls import (Tool, ToolChoice, ToolParser, marks_special_tokens, parse_tool_choice, parse_tools,
                               parser_for, template_renders_tools, tool_messages)

Prompt = Union[str, list[int]]
Messages = list[dict[str, Any]]


def engine_config(model: str | None, dtype: str | None, options: dict) -> EngineConfig:
    return EngineConfig(model=model, dtype=dtype or "auto", **options)


@dataclass
class Prepared:
    prompt: str | None
    token_ids: list[int]


def prepare(tokenizer: Tokenizer, prompt: Prompt) -> Prepared:
    if isinstance(prompt, str):
        return Prepared(prompt, tokenizer.encode(prompt))
    return Prepared(None, list(prompt))


def chat_prompt(tokenizer: Tokenizer, messages: Messages) -> Prepared:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return Prepared(text, tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ToolRequest:
    """A chat's tools as the embedded clients take them (OpenAI's `tools` and `tool_choice`)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parser: ToolParser
    parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[dict[str, Any]], tool_choice: Any, parser: ToolParser,
           parallel: bool = True) -> ToolRequest:
        """ToolError (a ValueError naming the field) for malformed tools or a choice naming no tool."""
        parsed = parse_tools(list(tools))
        return cls(parsed, parse_tool_choice(tool_choice, parsed), parser, parallel)

    @classmethod
    def for_model(cls, source: ModelSource, tools: Sequence[dict[str, Any]], tool_choice: Any, parallel: bool,
                  tool_call_parser: str) -> ToolRequest:
        """The embedded clients' `chat(tools=...)` arguments, with the parser named or chosen for `source`."""
        parser = parser_for(tool_call_parser, source.tokenizer.chat_template, source.config.architecture)
        return cls.of(tools, tool_choice, parser, parallel)

    def prompt(self, tokenizer: Tokenizer, messages: Messages) -> Prepared:
        rendered, extra = tool_messages(messages, self.tools, self.parser,
                                        template_renders_tools(tokenizer.chat_template))
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **extra)
        return Prepared(text, tokenizer.encode(text, add_special_tokens=False))

    def params(self, tokenizer: Tokenizer, params: SamplingParams) -> SamplingParams:
        """`params` with the grammar of a forced call, and special tokens kept where the format's marker is one."""
        if self.choice.mode == "none":
            return params
        if self.choice.forced:
            params = dataclasses.replace(params, guide=self.parser.forced_guide(self.tools, self.choice,
                                                                                self.parallel))
        if marks_special_tokens(self.parser, tokenizer):
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def read(self, out: RequestOutput) -> RequestOutput:
        """Each sample's tool calls and content, read out of its text."""
        if self.choice.mode == "none":
            return out
        for sample in out.outputs:
            sample.content, sample.tool_calls = self.parser.parse(sample.text, parallel=self.parallel)
        return out
