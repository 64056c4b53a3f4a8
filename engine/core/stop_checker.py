"""Streaming stop-string detection that never emits any part of a stop string.

"First occurrence" means the occurrence that *completes* first (earliest end, ties broken by
earliest start): that is what a streaming detector can decide without look-ahead. It differs
from "earliest start" only when one stop string contains another as an inner substring.
"""
from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the stop occurrence in ``text`` that ends first, or None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        start = text.find(s)
        if start >= 0:
            cand = (start + len(s), start, s)
            best = cand if best is None or cand[:2] < best[:2] else best
    return None if best is None else (best[1], best[2])


def truncate_at_stop(text: str, stops: Sequence[str], include_stop: bool = False) -> str:
    """Reference (non-streaming) truncation that ``StopChecker`` output must equal."""
    hit = find_stop(text, stops)
    if hit is None:
        return text
    start, s = hit
    return text[: start + len(s)] if include_stop else text[:start]


def _held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopChecker:
    """Per-sequence filter over detokenised deltas: ``feed`` returns (safe text, stop hit)."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.stop_reason: str | None = None  # the stop string that matched
        self._pending = ""
        self._emitted: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def truncated_text(self) -> str:
        """All text emitted so far (feeds plus flush)."""
        return "".join(self._emitted)

    def _emit(self, text: str) -> str:
        self._emitted.append(text)
        return text

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._pending + delta
        hit = find_stop(text, self.stops)
        if hit is not None:
            start, s = hit
            self.stop_reason, self._pending = s, ""
            return self._emit(text[: start + len(s)] if self.include_stop else text[:start]), True
        cut = len(text) - _held_suffix_len(text, self.stops)
        self._pending = text[cut:]
        return self._emit(text[:cut]), False

    def flush(self) -> str:
        """Release held-back text when the sequence ends for a reason other than a stop string."""
        text, self._pending = self._pending, ""
        return self._emit(text)
