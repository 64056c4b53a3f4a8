"""The Responses API's `reasoning` request field, for a model that thinks in `<think>…</think>`.

`reasoning.effort` "none" turns thinking off (the chat template's `enable_thinking` false); left out or null,
the template's default holds. Other efforts (minimal, low, medium, high, xhigh) would need a thinking budget
chosen per effort, which OpenAI does not define in tokens: they are refused, naming the field, rather than
guessed. `reasoning.summary` (and the older `generate_summary`) is refused too: no summariser runs, and a
response's reasoning item carries the thinking itself as reasoning_text, with an empty `summary`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import bad_request

KNOWN = ("effort", "summary", "generate_summary")
EFFORT_OFF = "none"


@dataclass(frozen=True)
class ReasoningSetting:
    effort: str | None = None  # None: the model's default

    def chat_fields(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat body's fields for this setting: enable_thinking false for effort none. 400 naming
        reasoning.effort when `body` turns thinking on by the chat route's own fields at the same time."""
        if self.effort != EFFORT_OFF:
            return {}
        kwargs = body.get("chat_template_kwargs")
        asked = [body.get("enable_thinking"), kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None]
        if True in asked:
            raise bad_request("'reasoning.effort' none turns thinking off, and 'enable_thinking' turns it on; give "
                              "one.", "reasoning.effort")
        return {"enable_thinking": False}

    def echo(self) -> dict[str, Any]:
        return {"effort": self.effort, "summary": None}


def parse_reasoning(value: Any) -> ReasoningSetting:
    """`reasoning` as a ReasoningSetting; 400 naming the field for what this server cannot honour."""
    if value is None:
        return ReasoningSetting()
    if not isinstance(value, dict):
        raise bad_request("'reasoning' must be an object ({\"effort\": ...}).", "reasoning")
    unknown = [key for key in value if key not in KNOWN]
    if unknown:
        raise bad_request(f"'reasoning.{unknown[0]}' is not a field this server knows; it takes effort.",
                          f"reasoning.{unknown[0]}", "unsupported_parameter")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            raise bad_request(f"'reasoning.{key}' is not supported on /v1/responses: no summary is written; the "
                              "reasoning item carries the thinking itself as reasoning_text.", f"reasoning.{key}",
                              "unsupported_parameter")
    effort = value.get("effort")
    if effort is not None and effort != EFFORT_OFF:
        raise bad_request(f"'reasoning.effort' {effort!r} is not supported on /v1/responses: only none (thinking "
                          "off) is; leave it out for the model's own thinking.", "reasoning.effort",
                          "unsupported_parameter")
    return ReasoningSetting(effort)
