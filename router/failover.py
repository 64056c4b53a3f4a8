"""Failover: what happens to requests when an actor fails them or dies, and to requests that wait for one.

A request that has not streamed a token is dispatched again (up to `max_attempts`), one that has ends with an
error; a lost prefill side falls back to prefilling on the decode actor. A request with no decode actor up is
parked, dispatched when one comes up, and failed after `park_timeout`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from actors.spec import Role
from actors.supervisor import ActorHandle, Supervisor
from router.handoff import HANDOFF_PHASES, Handoff, Phase, Routed
from transport import messages as m

log = logging.getLogger("router")
WATCH_SECONDS = 0.25


class RequestFailedError(RuntimeError):
    """The request could not be completed (after retries, or after tokens had already been streamed)."""


class NoCapacityError(RequestFailedError):
    """No decode actor came (back) up within `park_timeout`: worth retrying later (the server's 503)."""


class Failover:
    def __init__(self, supervisor: Supervisor, routed: dict[str, Routed], handoff: Handoff,
                 dispatch: Callable[[Routed], object], on_error: Callable[[str, Exception], None],
                 max_attempts: int, park_timeout: float) -> None:
        self.supervisor, self.routed, self.handoff = supervisor, routed, handoff
        self._dispatch, self._on_error = dispatch, on_error
        self.max_attempts, self.park_timeout = max_attempts, park_timeout

    def on_request_failed(self, handle: ActorHandle, msg: m.RequestFailed) -> None:
        routed = self.routed.get(msg.request_id)
        if routed is None:
            return
        log.warning("%s failed on %s: %s", msg.request_id, handle.actor_id, msg.reason,
                    extra={"request_id": msg.request_id})
        if routed.awaits(Phase.PREFILLING, handle.actor_id):
            self.handoff.fall_back(routed)
        elif msg.retryable and not routed.streamed:
            self.retry(routed, msg.reason)
        else:
            self.fail(routed, msg.reason)

    def on_down(self, handle: ActorHandle) -> None:
        """Every request the actor held: retried or failed (decode), or prefilled on the decode actor."""
        for routed in list(self.routed.values()):
            if routed.decode == handle.actor_id:
                self._decode_lost(routed)
            elif routed.prefill == handle.actor_id and routed.phase in HANDOFF_PHASES:
                self.handoff.fall_back(routed)

    def _decode_lost(self, routed: Routed) -> None:
        if routed.phase is Phase.PREFILLING:
            self.handoff.send(routed.prefill, m.AbortRequest(routed.request_id))
        if routed.streamed:
            self.fail(routed, f"decode actor {routed.decode} died after streaming tokens")
        else:
            self.retry(routed, f"decode actor {routed.decode} died")

    def retry(self, routed: Routed, reason: str) -> None:
        if routed.attempts >= self.max_attempts:
            self.fail(routed, f"{reason} (after {routed.attempts} attempts)")
            return
        log.info("retrying %s elsewhere: %s", routed.request_id, reason, extra={"request_id": routed.request_id})
        routed.decode = routed.prefill = None
        self._dispatch(routed)

    def park(self, routed: Routed) -> None:
        routed.move(Phase.PARKED)
        routed.parked_at = time.monotonic()

    def unpark(self) -> None:
        for routed in self._parked():
            self._dispatch(routed)

    def parked_count(self) -> int:
        return len(self._parked())

    def _parked(self) -> list[Routed]:
        return [r for r in self.routed.values() if r.phase is Phase.PARKED]

    async def watch(self) -> None:
        """Fail requests that waited too long for a decode actor, and retry parked ones when one is up."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            self.expire_parked(time.monotonic())
            if self.supervisor.ready(Role.DECODE):
                self.unpark()

    def expire_parked(self, now: float) -> None:
        for routed in self._parked():
            if now - routed.parked_at > self.park_timeout:
                self.fail(routed, f"no decode actor became available within {self.park_timeout:g} s",
                          NoCapacityError)

    def fail(self, routed: Routed, reason: str, error: type[RequestFailedError] = RequestFailedError) -> None:
        self.forget(routed)
        self._on_error(routed.request_id, error(reason))

    def forget(self, routed: Routed) -> None:
        self.routed.pop(routed.request_id, None)
