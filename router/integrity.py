"""Integrity checks on demand: ask one actor to verify its block pool and wait for its report."""
from __future__ import annotations

import asyncio

from actors.supervisor import ActorHandle, Supervisor
from transport import messages as m


class IntegrityChecks:
    """One outstanding check per actor; the router hands this part the actors' IntegrityReport messages."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor
        self._waiters: dict[str, asyncio.Future] = {}

    async def check(self, actor_id: str, timeout: float = 10.0) -> m.IntegrityReport:
        """Ask one actor to verify its block pool; raises TimeoutError if it does not answer."""
        future = self._waiters[actor_id] = asyncio.get_running_loop().create_future()
        if not await self._supervisor.by_id(actor_id).send(m.CheckIntegrity()):
            raise ConnectionError(f"actor {actor_id} is not reachable")
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._waiters.pop(actor_id, None)

    def on_report(self, handle: ActorHandle, msg: m.IntegrityReport) -> None:
        future = self._waiters.get(handle.actor_id)
        if future is not None and not future.done():
            future.set_result(msg)
