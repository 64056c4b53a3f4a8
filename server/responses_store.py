"""The responses /v1/responses keeps (`store`, the default), for `GET /v1/responses/{id}` and for a later
request's `previous_response_id`: bounded in count, in bytes and in age, oldest dropped first.

Each entry is kept as JSON text (its size is exact and nothing can change it once stored): the Response
object as returned, and the conversation so far as Responses items (every earlier turn's input and output,
without instructions, which previous_response_id does not carry over). An entry belongs to the credential
that created it (a digest of its bearer token): another one is told the id does not exist.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class StoreLimits:
    entries: int = 1024  # responses kept at most
    bytes: int = 64 << 20  # their JSON text, summed
    seconds: float = 3600.0  # how long one is kept after it is stored

    def __post_init__(self) -> None:
        if self.entries < 1 or self.bytes < 1:
            raise ValueError(f"entries and bytes must be at least 1, got {self.entries} and {self.bytes}")
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")

    def describe(self) -> str:
        return f"at most {self.entries} responses, {self.bytes} bytes, each for {self.seconds:g} s"


@dataclass(frozen=True)
class StoredResponse:
    id: str
    owner: str
    body: bytes  # the Response object, as JSON
    items: bytes  # the conversation so far, as a JSON array of items
    stored_at: float  # the store's clock

    @property
    def size(self) -> int:
        return len(self.body) + len(self.items)

    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.items)

    def response(self) -> dict[str, Any]:
        return json.loads(self.body)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseStore:
    """Stored responses by id, oldest first. Every call first drops the entries older than the age limit; a put
    then drops the oldest until the count and bytes fit."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def bytes(self) -> int:
        self._expire()
        return self._bytes

    def put(self, response_id: str, owner: str, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keeps the response; False (and nothing kept) when it alone is larger than the byte limit."""
        self._expire()
        entry = StoredResponse(response_id, owner, _json(body), _json(items), self._clock())
        if entry.size > self.limits.bytes:
            return False
        self._drop(response_id)
        while self._entries and (len(self._entries) >= self.limits.entries
                                 or self._bytes + entry.size > self.limits.bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = entry
        self._bytes += entry.size
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The entry, None when it is unknown, expired, deleted or another credential's."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size

    def _expire(self) -> None:
        horizon = self._clock() - self.limits.seconds
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > horizon:
                break
            self._drop(oldest.id)
