"""Drains: move every request off a running prefill or decode actor, then stop it (`POST /admin/drain`, or an
actor's own `Leaving` on SIGTERM); the supervisor starts a fresh one at once, a rolling restart."""
from __future__ import annotations

import asyncio
import logging

from actors.spec import Role
from actors.supervisor import ActorHandle, ActorState, Supervisor
from router.failover import Failover
from transport import messages as m

log = logging.getLogger("router")
LEAVING_SETTLE_SECONDS = 0.5  # after an actor's Leaving, how long to wait for the server's own stop signal


class Drains:
    """Drains asked for, and those an actor's Leaving starts (held until done). Once `stop` is called (the
    server is shutting down) actors that leave are let go, not drained."""

    def __init__(self, supervisor: Supervisor, failover: Failover) -> None:
        self._supervisor = supervisor
        self._failover = failover
        self.stopping = False
        self._tasks: set[asyncio.Task] = set()

    def stop(self) -> None:
        self.stopping = True

    async def drain(self, actor_id: str) -> int:
        """Move every request off the actor while it still runs, then stop it. Returns the number of requests
        moved. KeyError for an unknown actor, ValueError for one that cannot be drained."""
        handle = self._supervisor.by_id(actor_id)
        if handle.spec.role is Role.DRAFT or handle.spec.remote:
            raise ValueError(f"actor {actor_id} is a {'remote' if handle.spec.remote else 'draft'} actor; only "
                             "local prefill and decode actors can be drained")
        if handle.state is not ActorState.READY or handle.draining or handle.changing_role is not None:
            doing = "draining" if handle.draining else "changing role" if handle.changing_role else handle.state.value
            raise ValueError(f"actor {actor_id} is {doing}")
        handle.draining = True  # placement skips it from now on
        moved = self._failover.move_off(handle)
        log.info("draining actor %s: %d requests moved", actor_id, moved, extra={"actor_id": actor_id})
        await handle.send(m.Shutdown())
        return moved

    def on_leaving(self, handle: ActorHandle, msg: m.Leaving) -> None:
        """An actor got SIGTERM. When the whole server is stopping (a signal to the process group reaches every
        process at once) let it be; otherwise drain it, after a moment in which the server's own signal would
        have arrived."""
        async def drain_unless_stopping() -> None:
            await asyncio.sleep(LEAVING_SETTLE_SECONDS)
            if not self.stopping and handle.state is ActorState.READY and not handle.draining:
                await self.drain(handle.actor_id)

        log.info("actor %s was asked to stop", handle.actor_id, extra={"actor_id": handle.actor_id})
        task = asyncio.ensure_future(drain_unless_stopping())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
