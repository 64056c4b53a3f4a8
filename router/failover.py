"""Failover: what happens to requests when an actor fails them, dies or drains, and to requests that wait for one.

A request that has not streamed a token is dispatched again (up to `max_attempts`). One that has streamed is
*migrated*: resumed on another decode actor (or on the restarted one) from the tokens the client already has,
by prefilling prompt + those tokens and decoding on, so the client sees a pause and the same text an
uninterrupted run gives (greedy, and seeded sampling, whose draws are keyed by position). After
`max_migrations` moves it ends with an error. A lost prefill side falls back to prefilling on the decode actor.
A request with no decode actor up is parked, dispatched when one comes up, and failed after `park_timeout`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from actors.spec import Role
from actors.supervisor import ActorHandle, Supervisor
from engine.core.client_protocol import NoCapacityError, RequestFailedError
from engine.core.errors import RequestError
from router.handoff import HANDOFF_PHASES, Handoff, Phase, Routed
from transport import messages as m

log = logging.getLogger("router")
WATCH_SECONDS = 0.25


@dataclass
class MigrationCounters:
    migrations: int = 0  # streams resumed on another decode actor
    migrated_tokens: int = 0  # tokens those streams had already emitted (recomputed, not re-sent)
    failed_migrations: int = 0  # streams that could not be moved (too many moves, or no decode actor in time)


class Failover:
    def __init__(self, supervisor: Supervisor, routed: dict[str, Routed], handoff: Handoff,
                 dispatch: Callable[[Routed], object], on_error: Callable[[str, Exception], None],
                 max_attempts: int, park_timeout: float, max_migrations: int = 3) -> None:
        self.supervisor, self.routed, self.handoff = supervisor, routed, handoff
        self._dispatch, self._on_error = dispatch, on_error
        self.max_attempts, self.park_timeout, self.max_migrations = max_attempts, park_timeout, max_migrations
        self.counters = MigrationCounters()

    def on_request_failed(self, handle: ActorHandle, msg: m.RequestFailed) -> None:
        routed = self.routed.get(msg.request_id)
        if routed is None:
            return
        log.warning("%s failed on %s: %s", msg.request_id, handle.actor_id, msg.reason,
                    extra={"request_id": msg.request_id})
        if routed.awaits(Phase.PREFILLING, handle.actor_id):
            self.handoff.fall_back(routed)
        elif msg.param is not None:
            self.forget(routed)
            self._on_error(routed.request_id, RequestError(msg.reason, msg.param))
        elif not msg.retryable:
            self.fail(routed, msg.reason)
        elif routed.streamed:
            self.migrate(routed, msg.reason)
        else:
            self.retry(routed, msg.reason)

    def on_down(self, handle: ActorHandle) -> None:
        """Every request the actor held: retried or migrated (decode), or prefilled on the decode actor."""
        for routed in list(self.routed.values()):
            if routed.decode == handle.actor_id:
                self._decode_lost(routed, f"decode actor {handle.actor_id} died")
            elif routed.prefill == handle.actor_id and routed.phase in HANDOFF_PHASES:
                self.handoff.fall_back(routed)

    def move_off(self, handle: ActorHandle) -> int:
        """A planned drain: every request the actor holds goes elsewhere now, while it still runs (it is told
        to drop each one). Returns how many moved."""
        moved = 0
        for routed in list(self.routed.values()):
            if routed.decode == handle.actor_id:
                if routed.phase in HANDOFF_PHASES:
                    self.handoff.send(routed.decode, m.ReleaseReservation(routed.request_id))
                else:
                    self.handoff.send(routed.decode, m.AbortRequest(routed.request_id))
                self._decode_lost(routed, f"decode actor {handle.actor_id} is draining", planned=True)
                moved += 1
            elif routed.prefill == handle.actor_id and routed.phase in HANDOFF_PHASES:
                self.handoff.send(routed.prefill, m.AbortRequest(routed.request_id))
                self.handoff.fall_back(routed)
                moved += 1
        return moved

    def _decode_lost(self, routed: Routed, reason: str, planned: bool = False) -> None:
        if routed.phase is Phase.PREFILLING:
            self.handoff.send(routed.prefill, m.AbortRequest(routed.request_id))
        if routed.streamed:
            self.migrate(routed, reason)
        else:
            if planned:
                routed.attempts -= 1  # a drain is no failed attempt
            self.retry(routed, reason)

    def migrate(self, routed: Routed, reason: str) -> None:
        """Resume a stream elsewhere from the tokens already forwarded to the client."""
        if routed.migrations >= self.max_migrations:
            self.counters.failed_migrations += 1
            self.fail(routed, f"{reason}; the stream had already moved {routed.migrations} times")
            return
        resume = {i: list(routed.emitted.get(i, ())) for i in range(routed.request.params.n)
                  if i not in routed.finished_samples}
        routed.migrations += 1
        self.counters.migrations += 1
        self.counters.migrated_tokens += sum(map(len, resume.values()))
        log.info("migrating %s off %s after %d tokens: %s", routed.request_id, routed.decode,
                 sum(map(len, resume.values())), reason, extra={"request_id": routed.request_id})
        routed.request = replace(routed.request, resume=resume)
        routed.moved_from, routed.decode, routed.prefill = routed.decode, None, None
        self._dispatch(routed)

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
                if routed.streamed:
                    self.counters.failed_migrations += 1
                self.fail(routed, f"no decode actor became available within {self.park_timeout:g} s",
                          NoCapacityError)

    def fail(self, routed: Routed, reason: str, error: type[RequestFailedError] = RequestFailedError) -> None:
        self.forget(routed)
        self._on_error(routed.request_id, error(reason))

    def forget(self, routed: Routed) -> None:
        self.routed.pop(routed.request_id, None)
