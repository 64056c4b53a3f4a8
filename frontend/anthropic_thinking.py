"""Anthropic's `thinking` request field, for a model that thinks in `<think>…</think>` (the front door's
reasoning parser), as what the chat route runs:

- `{"type": "enabled", "budget_tokens": N}`: the chat template's `enable_thinking` true, and the thinking
  held to N tokens: past them the engine forces the close tag (engine/sampling/thinking_budget.py);
- `{"type": "adaptive"}`: `enable_thinking` true, the model thinks as long as it does;
- `{"type": "disabled"}`: `enable_thinking` false (Qwen3's template writes an empty think block);
- left out: the template's default.

`display` is `summarized` (the thinking returned: the model's own, in full) or `omitted` (the thinking block
comes back empty). A reply's thinking is its first content block, `{"type": "thinking", "thinking", "signature":
""}`: the signature is empty, since there is nothing to verify on a local model, and a thinking block handed
back in a later turn is dropped from the prompt whatever its signature. `between_tools` and any other sub-field
are refused, naming the field. Knows nothing of HTTP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("enabled", "adaptive", "disabled")
DISPLAYS = ("summarized", "omitted")
FIELDS = {"enabled": ("type", "budget_tokens", "display"), "adaptive": ("type", "display"), "disabled": ("type",)}


class ThinkingError(ValueError):
    """A `thinking` value this server cannot honour; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Thinking:
    """A request's thinking setting. `enabled`: None leaves the template's default."""

    enabled: bool | None = None
    budget_tokens: int | None = None
    shown: bool = True  # display: summarized (shown) or omitted

    @property
    def asked(self) -> bool:
        """Whether the request asks the model to think (enabled or adaptive)."""
        return self.enabled is True

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enabled is None else {"enable_thinking": self.enabled}


DEFAULT = Thinking()


def parse_thinking(value: Any) -> Thinking:
    """`thinking` as a Thinking; ThinkingError naming the field for anything malformed or unsupported."""
    if value is None:
        return DEFAULT
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ThinkingError("thinking", "'thinking' must be an object with a 'type' (enabled, adaptive or "
                                        "disabled).")
    kind = value["type"]
    if kind not in KINDS:
        raise ThinkingError("thinking.type", f"'thinking.type' {kind!r} is not supported by this server; it takes "
                                             f"{', '.join(KINDS)}.")
    extra = [key for key in value if key not in FIELDS[kind]]
    if extra:
        raise ThinkingError(f"thinking.{extra[0]}", f"'thinking.{extra[0]}' is not supported with 'thinking.type' "
                                                    f"{kind} by this server.")
    if kind == "disabled":
        return Thinking(enabled=False)
    return Thinking(True, _budget(value) if kind == "enabled" else None, _shown(value.get("display")))


def _budget(value: dict[str, Any]) -> int:
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ThinkingError("thinking.budget_tokens", f"'thinking.budget_tokens' must be a positive integer (the "
                                                      f"most tokens the thinking may take), got {budget!r}.")
    return budget


def _shown(display: Any) -> bool:
    if display is None:
        return True
    if display not in DISPLAYS:
        raise ThinkingError("thinking.display", f"'thinking.display' must be summarized or omitted, got "
                                                f"{display!r}.")
    return display == "summarized"


def thinking_block(text: str, shown: bool = True) -> dict[str, Any]:
    """A reply's thinking as Anthropic's content block (empty when display is omitted)."""
    return {"type": "thinking", "thinking": text if shown else "", "signature": ""}
