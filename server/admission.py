"""Admission control: how many generation requests are in flight, and whether new ones are still taken."""
from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Iterator

from server.errors import ApiError

RETRY_AFTER_SECONDS = 1


class Admission:
    """Refuses new requests with 429 when `max_active` are in flight, and with 503 once draining."""

    def __init__(self, max_active: int) -> None:
        self._max_active = max_active
        self._active: set[str] = set()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def active_ids(self) -> list[str]:
        return sorted(self._active)

    def check_open(self) -> None:
        if self._draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", None, "shutting_down")

    def admit(self, request_id: str) -> None:
        self.check_open()
        if len(self._active) >= self._max_active:
            raise ApiError(429, f"the server is at its limit of {self._max_active} requests in flight; retry "
                           "shortly", None, "queue_full", {"Retry-After": str(RETRY_AFTER_SECONDS)})
        self._active.add(request_id)
        self._idle.clear()

    def release(self, request_id: str) -> None:
        self._active.discard(request_id)
        if not self._active:
            self._idle.set()

    @contextmanager
    def slot(self, request_id: str) -> Iterator[None]:
        self.admit(request_id)
        try:
            yield
        finally:
            self.release(request_id)

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
