"""Which of the three tool-call formats a model speaks, chosen per model family or by `--tool-call-parser`.

- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block
  per call;
- `llama3` (Llama 3.1+ JSON tool calling): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

Each concern has its module, keyed by this enum: reading the output (tool_parsers), writing the tools and
earlier calls into the prompt (tool_prompts), and the grammar of a forced call (tool_grammar).
"""
from __future__ import annotations

import enum


class ToolFormat(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


PARSER_NAMES = tuple(f.value for f in ToolFormat)
# Text that announces calls in each format, as a chat template that speaks it spells it.
TEMPLATE_MARKERS = (("<tool_call>", ToolFormat.HERMES), ("[TOOL_CALLS]", ToolFormat.MISTRAL),
                    ("<|python_tag|>", ToolFormat.LLAMA3))


def choose_format(name: str, chat_template: str | None, architecture: str | None) -> ToolFormat:
    """`name` (one of PARSER_NAMES), or for "auto" the format the chat template spells, else the
    architecture's usual one (mistral -> mistral), else hermes."""
    if name != "auto":
        if name not in PARSER_NAMES:
            raise ValueError(f"unknown tool-call parser {name!r}; expected auto or one of {', '.join(PARSER_NAMES)}")
        return ToolFormat(name)
    template = chat_template or ""
    for marker, fmt in TEMPLATE_MARKERS:
        if marker in template:
            return fmt
    if "mistral" in (architecture or "").lower():
        return ToolFormat.MISTRAL
    return ToolFormat.HERMES
