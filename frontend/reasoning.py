"""Reasoning models that think in `<think>…</think>` before they answer (DeepSeek-R1 and its distills, Qwen3,
QwQ): the thinking told from the answer, whole or as it streams, and constraints moved past the thinking.

Where an output starts depends on the prompt as much as on the model (`Start`): DeepSeek-R1's template ends
its generation prompt with `<think>\\n`, so the output begins inside the thinking and only closes it; Qwen3's
writes nothing, and the model opens the block itself; with `enable_thinking: false` Qwen3's template writes an
empty block into the prompt, so the output is all answer. The two parsers differ only where the prompt leaves
it open: `qwen3` reads an output as thinking only if it opens with `<think>`, `deepseek_r1` reads it as
thinking until `</think>` whether or not it opened the block (R1 models often leave the opening out).

What is split off: the text between the tags is the reasoning (as written); the answer is what follows
`</think>`, without the blank lines models put after the tag. An output that never closes its block (cut by
max_tokens) is all reasoning; an output with no thinking has no reasoning (None).

`split_reasoning(text, parser, start)` and the incremental `ReasoningStream` are the API every route uses
(chat's `reasoning_content`, and the Responses and Messages shapes). `think_first(guide, parser, start)` makes
a constraint apply to the answer: free text inside the think block, then the constraint (an xgrammar
structural tag). A raw EBNF grammar that spells a think tag itself constrains the whole output, as its author
wrote it.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Sequence

from engine.sampling.structured import Guide
from frontend.json_scan import held_back

OPEN = "<think>"
CLOSE = "</think>"
PARSER_NAMES = ("auto", "deepseek_r1", "qwen3", "none")
# What a model writes between `</think>` and its answer, which a constrained answer may follow.
GAP_PATTERN = r"[ \n]{0,4}"


class ReasoningFormat(str, enum.Enum):
    DEEPSEEK_R1 = "deepseek_r1"
    QWEN3 = "qwen3"


class Start(str, enum.Enum):
    """Where an output begins: inside the think block (the prompt opened it), in the answer (the prompt holds a
    closed block: thinking off), or open (the model may open a block first)."""

    THINKING = "thinking"
    ANSWER = "answer"
    OPEN = "open"


@dataclass(frozen=True)
class ReasoningParser:
    format: ReasoningFormat
    open: str = OPEN
    close: str = CLOSE

    @property
    def name(self) -> str:
        return self.format.value

    @property
    def implicit_open(self) -> bool:
        """Whether an output thinks until the close tag even without opening the block (DeepSeek-R1)."""
        return self.format is ReasoningFormat.DEEPSEEK_R1

    def start(self, prompt: str | None) -> Start:
        """Where the output of `prompt` (the rendered chat) begins; None (token ids given): the model decides."""
        tail = (prompt or "").rstrip()
        if tail.endswith(self.open):
            return Start.THINKING
        if tail.endswith(self.close):
            return Start.ANSWER
        return Start.OPEN


def choose_parser(name: str, chat_template: str | None, tag_tokens: bool,
                  opening: str | None = None) -> ReasoningParser | None:
    """`name` (one of PARSER_NAMES). auto: a parser when the chat template writes a think tag or the vocabulary
    has both tags as tokens (`tag_tokens`), else none; deepseek_r1 when the template's generation prompt
    (`opening`, the prompt of a one-message chat) opens the block, else qwen3, which splits only what the
    output or the prompt opens."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(PARSER_NAMES)}")
    if name == "none":
        return None
    if name != "auto":
        return ReasoningParser(ReasoningFormat(name))
    template = chat_template or ""
    if OPEN not in template and not tag_tokens:
        return None
    opens = opening is not None and opening.rstrip().endswith(OPEN)
    return ReasoningParser(ReasoningFormat.DEEPSEEK_R1 if opens else ReasoningFormat.QWEN3)


# ---------------------------------------------------------------------------------------- reading the output

class ReasoningStream:
    """One sample's text, fed as it grows, split into reasoning and answer. A tag split across deltas is held
    back until it is known; `feed` returns (new reasoning text, new answer text)."""

    def __init__(self, parser: ReasoningParser, start: Start) -> None:
        self._parser = parser
        self._state = _STATES[start]
        self._pending = ""  # text not yet known to be reasoning or answer
        self.reasoning: str | None = "" if self._state == _THINK else None  # all of it so far
        self._trim = False  # the answer follows a close tag: its leading blank lines go

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        self._pending += delta
        reasoning, answer = "", ""
        while True:
            step = self._step(finished)
            if step is None:
                break
            reasoning += step[0]
            answer += step[1]
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        return reasoning, self._trim_answer(answer)

    def _step(self, finished: bool) -> tuple[str, str] | None:
        """One move of the state machine over the pending text: (reasoning, answer) it let go, or None when it
        has to wait for more text."""
        text = self._pending
        if self._state == _BEFORE:
            return self._opening(text, finished)
        if self._state == _THINK:
            return self._thinking(text, finished)
        self._pending = ""
        return ("", text) if text else None

    def _opening(self, text: str, finished: bool) -> tuple[str, str] | None:
        stripped = text.lstrip()
        tag = self._parser.open
        if not finished and tag.startswith(stripped):
            return None  # nothing yet, or what may be the opening tag
        if stripped.startswith(tag):
            self._pending = stripped[len(tag):]
        self._state = _THINK if stripped.startswith(tag) or self._parser.implicit_open else _ANSWER
        if self._state == _THINK:
            self.reasoning = self.reasoning or ""
        return "", ""

    def _thinking(self, text: str, finished: bool) -> tuple[str, str] | None:
        close = text.find(self._parser.close)
        if close >= 0:
            self._pending = text[close + len(self._parser.close):]
            self._state, self._trim = _ANSWER, True
            return text[:close], ""
        keep = 0 if finished else held_back(text, self._parser.close)
        out, self._pending = text[:len(text) - keep], text[len(text) - keep:]
        return (out, "") if out else None

    def _trim_answer(self, answer: str) -> str:
        """The answer without the blank lines between the close tag and it: dropped until text comes."""
        if not self._trim or not answer:
            return answer
        answer = answer.lstrip()
        self._trim = not answer
        return answer


_BEFORE, _THINK, _ANSWER = "before", "think", "answer"
_STATES = {Start.THINKING: _THINK, Start.ANSWER: _ANSWER, Start.OPEN: _BEFORE}


def split_reasoning(text: str, parser: ReasoningParser, start: Start = Start.OPEN) -> tuple[str | None, str]:
    """(reasoning or None when the output did not think, answer) of a finished output."""
    stream = ReasoningStream(parser, start)
    _, answer = stream.feed(text, finished=True)
    return stream.reasoning, answer


# ---------------------------------------------------------------------------------------- constraints

def think_first(guide: Guide, parser: ReasoningParser, start: Start) -> Guide:
    """`guide` applied to the answer: the think block's free text first where the output may think. An EBNF
    grammar that spells a think tag itself is left as it is."""
    if start is Start.ANSWER or _spells_tags(guide, parser):
        return guide
    answer = {"type": "sequence", "elements": [{"type": "regex", "pattern": GAP_PATTERN}, answer_format(guide)]}
    if start is Start.THINKING or parser.implicit_open:  # any text up to the close tag, an opening one included
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": parser.close}
        fmt: dict[str, Any] = {"type": "sequence", "elements": [thinking, answer]}
    else:
        block = {"type": "tag", "begin": parser.open, "content": {"type": "any_text"}, "end": parser.close}
        fmt = {"type": "or", "elements": [{"type": "sequence", "elements": [block, answer]}, answer_format(guide)]}
    return Guide("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def answer_format(guide: Guide) -> dict[str, Any]:
    """`guide` as a format of xgrammar's structural tags."""
    if guide.kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(guide.source)}
    if guide.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if guide.kind == "regex":
        return {"type": "regex", "pattern": guide.source}
    if guide.kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in guide.choices]}
    if guide.kind == "structural_tag":
        return json.loads(guide.source)["format"]
    return {"type": "grammar", "grammar": guide.source}


def _spells_tags(guide: Guide, parser: ReasoningParser) -> bool:
    return guide.kind == "grammar" and (parser.open in guide.source or parser.close in guide.source)


def special_tags(parser: ReasoningParser, special_ids: Sequence[int], encode: Any) -> bool:
    """Whether a tag is one special token of the vocabulary (`encode(text)` -> ids): the text must then keep
    special tokens for the parser to see it."""
    special = set(special_ids)
    return any(len(ids) == 1 and ids[0] in special for ids in (encode(parser.open), encode(parser.close)))
