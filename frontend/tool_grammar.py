"""The constraint of a forced tool call (tool_choice "required" or a named function): an xgrammar structural
tag that spells the format around the JSON schema of each function's parameters, so the arguments always
satisfy the schema. Built here as text; the engine compiles it where it runs, with the arguments' numbers and
whitespace bounded (engine.sampling.json_grammar)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from engine.sampling.structured import Guide
from frontend.tool_format import ToolFormat
from frontend.tools import Tool, ToolChoice


@dataclass(frozen=True)
class CallSpelling:
    """How one format writes a call: the text before the arguments (around the function's name), after them,
    between calls, and around the whole list."""

    begin: str  # with {name} where the JSON-quoted name goes
    end: str
    separator: str
    opening: str = ""
    closing: str = ""


SPELLINGS = {
    ToolFormat.HERMES: CallSpelling('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n"),
    ToolFormat.LLAMA3: CallSpelling('{{"name": {name}, "parameters": ', "}", "; "),
    ToolFormat.MISTRAL: CallSpelling('{{"name": {name}, "arguments": ', "}", ", ", "[TOOL_CALLS][", "]"),
}


def forced_guide(fmt: ToolFormat, tools: Sequence[Tool], choice: ToolChoice, parallel: bool) -> Guide:
    """The constraint for tool_choice required (one call of any tool, or several with parallel calls) or
    named (exactly one call of that function)."""
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    fmt_tag = _format(SPELLINGS[fmt], chosen, parallel and choice.mode != "named")
    return Guide("structural_tag", json.dumps({"type": "structural_tag", "format": fmt_tag}))


def _format(spelling: CallSpelling, tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    tags = [{"type": "tag", "begin": spelling.begin.format(name=json.dumps(t.name)),
             "content": {"type": "json_schema", "json_schema": t.schema},
             "end": spelling.end} for t in tools]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": spelling.separator, "at_least_one": True,
             "stop_after_first": not parallel}
    if not spelling.opening:
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": spelling.opening}, calls,
                                             {"type": "const_string", "value": spelling.closing}]}
