"""Fill-in-the-middle prompts (`suffix` on /v1/completions) for vocabularies that have FIM tokens."""
from __future__ import annotations

from engine.model.tokenizer import Tokenizer

# (prefix, suffix, middle) token spellings: StarCoder / SantaCoder, Qwen2.5-Coder and DeepSeek-style, CodeLlama.
FIM_TOKEN_SETS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                  ("<PRE>", "<SUF>", "<MID>"))


def fim_tokens(tokenizer: Tokenizer) -> tuple[str, str, str] | None:
    """The first FIM token set whose three tokens are all single tokens of the vocabulary, or None."""
    for names in FIM_TOKEN_SETS:
        if all(tokenizer.backend.token_to_id(t) is not None for t in names):
            return names
    return None


def fim_prompt(tokens: tuple[str, str, str], prompt: str, suffix: str) -> str:
    """Prefix-suffix-middle order, which all three families were trained on: the model writes the middle."""
    prefix_token, suffix_token, middle_token = tokens
    return f"{prefix_token}{prompt}{suffix_token}{suffix}{middle_token}"
