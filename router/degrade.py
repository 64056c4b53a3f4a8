"""Degrade instead of fail: when the last decode actor is lost and no replacement serves (it crash-loops, or on
Ray its node is gone and the cluster has no room for another), a prefill actor takes the decode role, colocated,
so that requests are served (slower) instead of failing after their wait for a decode actor.

A decode actor that has been down for `degrade_after` seconds counts as lost (at once when it is crash-looping:
its supervisor will not restart it). When a decode actor serves again, the stand-in goes back to prefilling, unless
the elastic planner is on: then the layout is the planner's to choose.
"""
from __future__ import annotations

import asyncio
import logging

from actors.spec import Role
from actors.supervisor import ActorHandle, ActorState, Supervisor
from router.elastic_settings import ElasticSettings
from router.roles import RoleChanges

log = logging.getLogger("router")


def lost_decode_role(handles: list[ActorHandle], now: float, after: float) -> str | None:
    """Why a prefill actor should take the decode role now, or None: no decode actor serves or is becoming one,
    and every decode actor is crash-looping or has been down for `after` seconds."""
    if any(h.changing_role is Role.DECODE for h in handles):
        return None
    decodes = [h for h in handles if h.spec.role is Role.DECODE]
    if not decodes or any(h.state is ActorState.READY for h in decodes):
        return None
    waiting = [h for h in decodes if h.state is not ActorState.FAILED]
    if any(h.down_at is None or now - h.down_at < after for h in waiting):
        return None
    failed = ", ".join(h.actor_id for h in decodes if h.state is ActorState.FAILED)
    down = ", ".join(f"{h.actor_id} down {now - h.down_at:.1f}s" for h in waiting)
    return "no decode actor serves: " + "; ".join(part for part in (failed and f"{failed} crash-looping", down) if part)


class Degrade:
    def __init__(self, supervisor: Supervisor, roles: RoleChanges, settings: ElasticSettings) -> None:
        self.supervisor, self.roles, self.settings = supervisor, roles, settings
        self.stand_ins: set[str] = set()  # prefill actors that took the decode role
        self._task: asyncio.Task | None = None

    def check(self, now: float) -> None:
        """From the router's upkeep loop: start a stand-in, or send one back to prefilling."""
        if not self.settings.degrade or self.roles.busy or (self._task is not None and not self._task.done()):
            return
        self.stand_ins = {a for a in self.stand_ins if self.supervisor.by_id(a).spec.role is Role.DECODE}
        reason = lost_decode_role(self.supervisor.handles, now, self.settings.degrade_after)
        if reason is not None:
            stand_in = self._stand_in()
            if stand_in is not None:
                log.warning("degrading: %s takes the decode role (%s)", stand_in.actor_id, reason)
                self._start(stand_in, Role.DECODE, f"degrade: {reason}")
            return
        back = None if self.settings.on else self._restorable()
        if back is not None:
            self._start(back, Role.PREFILL, "restore: a decode actor serves again")

    def _stand_in(self) -> ActorHandle | None:
        """The ready prefill actor that may change role (the first, in the layout's order)."""
        for handle in self.supervisor.ready(Role.PREFILL):
            if self.roles.refusal(handle, Role.DECODE) is None:
                return handle
        return None

    def _restorable(self) -> ActorHandle | None:
        """A stand-in, once another decode actor serves."""
        others = [h for h in self.supervisor.ready(Role.DECODE) if h.actor_id not in self.stand_ins]
        if not others:
            return None
        for actor_id in sorted(self.stand_ins):
            handle = self.supervisor.by_id(actor_id)
            if handle.spec.role is Role.DECODE and self.roles.refusal(handle, Role.PREFILL) is None:
                return handle
        return None

    def _start(self, handle: ActorHandle, role: Role, reason: str) -> None:
        async def change() -> None:
            try:
                if await self.roles.change(handle.actor_id, role, reason):
                    (self.stand_ins.add if role is Role.DECODE else self.stand_ins.discard)(handle.actor_id)
            except ValueError as exc:  # the layout moved on meanwhile
                log.info("no role change for %s: %s", handle.actor_id, exc)

        self._task = asyncio.ensure_future(change())

    def status(self) -> dict:
        return {"enabled": self.settings.degrade, "after_seconds": self.settings.degrade_after,
                "stand_ins": sorted(self.stand_ins)}
