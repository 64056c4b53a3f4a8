"""The engine's refusal of a request, and the field names it uses for what is not a request field."""
from __future__ import annotations

GUIDE_PARAM = "guide"  # a RequestError's param for a constraint that does not compile


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, duplicate id); `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
