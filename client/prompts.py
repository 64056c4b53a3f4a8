"""Prompts as the embedded clients take them: text, token ids or chat messages, tokenised once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from engine.config import EngineConfig
from engine.tokenizer import Tokenizer

Prompt = Union[str, list[int]]
Messages = list[dict[str, str]]


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
