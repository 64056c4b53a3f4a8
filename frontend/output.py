"""Reading a chat's output for tool calls: whole (the last output of LLM.chat / AsyncLLM.chat, an HTTP
response) or streamed (ToolCallReader)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.outputs import RequestOutput, ToolCall
from frontend.tool_parsers import ToolParser
from frontend.tool_stream import ToolCallReader


@dataclass(frozen=True)
class ToolCallOutput:
    """A chat whose output is read for tool calls: the format, and whether several calls may be kept."""

    parser: ToolParser
    parallel: bool = True

    def read(self, text: str, finish_reason: str | None = None) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a finished sample's text. A sample cut by max_tokens (finish_reason
        "length") keeps the calls that closed and drops the one it was writing."""
        return self.parser.parse(text, parallel=self.parallel, cut=finish_reason == "length")

    def read_output(self, out: RequestOutput) -> RequestOutput:
        """`out` with each sample's `tool_calls` and `content` read out of its text."""
        for sample in out.outputs:
            sample.content, sample.tool_calls = self.read(sample.text, sample.finish_reason)
        return out

    def reader(self) -> ToolCallReader:
        """A reader of one streamed sample."""
        return ToolCallReader(self.parser, self.parallel)
