"""Role changes of running actors, as the router drives them (the actor's side is actors/roles.py).

To change an actor from one role to the other, the router stops placing work on it (`ActorHandle.changing_role`),
moves every request off it with the drain's migration (router.failover.move_off: a stream resumes elsewhere from
the tokens its client has; a hand-off in flight is prefilled on its decode actor instead), tells the prefill actors
to forget its pool when it was a decode actor, then sends ChangeRole and waits for RoleChanged. The handle then
carries the new role and Ready, so placement sees the new layout at once, and the router attaches pools as for an
actor that came up. One change runs at a time. An actor that does not answer in time is killed: its supervisor
restarts it in its old role.

Each actor's calibration in a role is remembered, so that a change back reuses it; the first change into a role
takes the curves of a peer of that role on the same device and core count when there is one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

from actors.spec import Role
from actors.supervisor import ActorHandle, ActorState, Supervisor
from router.failover import Failover
from transport import messages as m

log = logging.getLogger("router")
SWITCHABLE = (Role.PREFILL, Role.DECODE)
HISTORY = 20  # role changes /status lists
CHANGE_WEIGHT = 0.5  # of the latest change in the mean time a change takes


@dataclass(frozen=True)
class RoleChangeRecord:
    actor_id: str
    old: str
    new: str
    reason: str
    seconds: float
    moved: int  # requests moved off the actor first
    at: float  # Unix time it ended
    ok: bool = True

    def to_dict(self) -> dict:
        return {"actor": self.actor_id, "from": self.old, "to": self.new, "reason": self.reason,
                "seconds": round(self.seconds, 3), "moved_requests": self.moved, "at": round(self.at, 3),
                "ok": self.ok}


class RoleChangeFailed(RuntimeError):
    """The actor could not be told, died, or did not answer in time."""


async def ask(supervisor: Supervisor, pending: dict[str, asyncio.Future], handle: ActorHandle,
              sent: Awaitable[bool], timeout: float, what: str, failed: type[Exception]) -> Any:
    """Wait for `handle`'s answer to what `sent` sends (its handler resolves `pending[actor_id]`) for `timeout`
    seconds; an actor that cannot be reached or does not answer in time raises `failed`, and the latter is killed:
    its supervisor restarts it as its spec says."""
    future = pending[handle.actor_id] = asyncio.get_running_loop().create_future()
    try:
        if not await sent:
            raise failed(f"{handle.actor_id} cannot be reached")
        return await asyncio.wait_for(future, timeout)
    except asyncio.TimeoutError:
        supervisor.kill(handle.actor_id)
        raise failed(f"{handle.actor_id} did not {what} within {timeout:g} s") from None
    finally:
        pending.pop(handle.actor_id, None)


class RoleChanges:
    def __init__(self, supervisor: Supervisor, failover: Failover, on_changed: Callable[[ActorHandle], Awaitable[None]],
                 share_kv: bool, timeout: float, default_seconds: float) -> None:
        self.supervisor, self.failover, self._on_changed = supervisor, failover, on_changed
        self.share_kv, self.timeout = share_kv, timeout
        self.pending: dict[str, asyncio.Future] = {}
        self.lock = asyncio.Lock()
        self.history: deque[RoleChangeRecord] = deque(maxlen=HISTORY)
        self.changes = self.failures = 0
        self.seconds_per_change = default_seconds  # an exponentially weighted mean of the changes so far
        self.calibrations: dict[tuple[str, Role], dict] = {}  # (actor, role) -> its curves in that role

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    def refusal(self, handle: ActorHandle, role: Role) -> str | None:
        """Why `handle` cannot change to `role` now, or None."""
        if role not in SWITCHABLE or handle.spec.role not in SWITCHABLE:
            return f"an actor changes role between prefill and decode only ({handle.actor_id} is {handle.spec.role})"
        if handle.spec.remote and not handle.spec.ray:
            return f"{handle.actor_id} is a worker on another host: its role is its own"
        if handle.parked or handle.widened is not None:
            return f"{handle.actor_id} {'lends' if handle.parked else 'runs on'} merged cores: split them first"
        if handle.state is not ActorState.READY or handle.draining or handle.changing_role is not None:
            return f"{handle.actor_id} is {handle.state.value}{', draining' if handle.draining else ''}" \
                   f"{', changing role' if handle.changing_role is not None else ''}"
        if role is Role.PREFILL and handle.spec.role is Role.DECODE \
                and self.supervisor.ready(Role.DECODE) == [handle]:
            return f"{handle.actor_id} is the last decode actor"
        return None

    async def change(self, actor_id: str, role: Role, reason: str) -> bool:
        """Change the actor's role (False when the change failed; ValueError when it may not change now)."""
        async with self.lock:
            handle = self.supervisor.by_id(actor_id)
            refusal = self.refusal(handle, role)
            if refusal is not None:
                raise ValueError(refusal)
            if handle.spec.role is role:
                return True
            return await self._change(handle, role, reason)

    async def _change(self, handle: ActorHandle, role: Role, reason: str) -> bool:
        old, started = handle.spec.role, time.monotonic()
        handle.changing_role = role
        try:
            moved = self.failover.move_off(handle)
            log.info("actor %s changes role %s -> %s (%d requests moved off): %s", handle.actor_id, old, role,
                     moved, reason, extra={"actor_id": handle.actor_id, "role": role.value, "reason": reason})
            if old is Role.DECODE:
                for prefill in self.supervisor.ready(Role.PREFILL):
                    await prefill.send(m.DetachPool(handle.actor_id))
            changed = await self._ask(handle, role)
        except RoleChangeFailed as exc:
            self._failed(handle, old, role, reason, str(exc), started)
            return False
        finally:
            handle.changing_role = None
        self._adopt(handle, changed)
        self.changes += 1
        took = time.monotonic() - started
        self.seconds_per_change = (1 - CHANGE_WEIGHT) * self.seconds_per_change + CHANGE_WEIGHT * took
        self.history.append(RoleChangeRecord(handle.actor_id, old.value, role.value, reason, took, moved, time.time()))
        log.info("actor %s is a %s actor now, %.2fs after it was asked (its engine: %.2fs)", handle.actor_id, role,
                 took, changed.seconds, extra={"actor_id": handle.actor_id})
        await self._on_changed(handle)
        return True

    async def _ask(self, handle: ActorHandle, role: Role) -> m.RoleChanged:
        if handle.ready is not None and handle.ready.calibration:
            self.calibrations[(handle.actor_id, handle.spec.role)] = handle.ready.calibration
        change = m.ChangeRole(role.value, self.share_kv, self._calibration_for(handle, role))
        # After the aborts move_off queued (each send is a task): ChangeRole must not overtake them
        sent = asyncio.ensure_future(handle.send(change))
        return await ask(self.supervisor, self.pending, handle, sent, self.timeout, "change role", RoleChangeFailed)

    def _adopt(self, handle: ActorHandle, changed: m.RoleChanged) -> None:
        """The handle carries the new role from now on (a restart starts the actor in it)."""
        role = Role(changed.role)
        handle.spec = replace(handle.spec, role=role, share_kv=self.share_kv and role is Role.DECODE,
                              calibration=changed.ready.calibration)
        handle.ready = changed.ready

    def _failed(self, handle: ActorHandle, old: Role, role: Role, reason: str, why: str, started: float) -> None:
        self.failures += 1
        self.history.append(RoleChangeRecord(handle.actor_id, old.value, role.value, f"{reason}; failed: {why}",
                                             time.monotonic() - started, 0, time.time(), ok=False))
        log.error("actor %s could not change role %s -> %s: %s", handle.actor_id, old, role, why,
                  extra={"actor_id": handle.actor_id})

    def _calibration_for(self, handle: ActorHandle, role: Role) -> dict | None:
        """Its own curves from an earlier time in `role`, else a peer's of that role on the same device and core
        count; None: the actor finds them on disk or measures them."""
        own = self.calibrations.get((handle.actor_id, role))
        if own is not None:
            return own
        for peer in self.supervisor.handles:  # a lost decode actor's curves serve its stand-in
            if peer.spec.role is role and peer.ready is not None and peer.ready.calibration \
                    and peer.spec.device == handle.spec.device and peer.spec.threads == handle.spec.threads:
                return peer.ready.calibration
        return None

    def on_changed(self, handle: ActorHandle, msg: m.RoleChanged) -> None:
        future = self.pending.get(handle.actor_id)
        if future is not None and not future.done():
            future.set_result(msg)

    def on_down(self, handle: ActorHandle) -> None:
        """The actor died while it changed: its supervisor restarts it in its old role."""
        future = self.pending.get(handle.actor_id)
        if future is not None and not future.done():
            future.set_exception(RoleChangeFailed(f"{handle.actor_id} went down while it changed role"))

    def status(self) -> dict:
        return {"changes": self.changes, "failed": self.failures,
                "seconds_per_change": round(self.seconds_per_change, 3),
                "recent": [r.to_dict() for r in self.history]}
