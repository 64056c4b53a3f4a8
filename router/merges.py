"""Merging actors' cores, as the router drives it (the actor's side is actors/cores.py).

A role change moves an actor between prefill and decode; it leaves each actor on its own share of the cores. On a
small CPU host the layout that serves long prompts best is often one decode actor on every core (a prompt
prefills on all of them), which no role change reaches. A merge makes it without a restart: the router parks the
other switchable actors (`ActorHandle.parked`: no new work; each request they hold moves to the survivor with the
drain's migration, router.failover.move_off) and sends the survivor SetCores with their threads and cores added to
its own; it answers CoresSet once its steps run on them. The parked actors keep their loaded models and sit idle.
A split undoes it: the survivor is narrowed back to its own cores first, then the parked actors take work again.

Every step has an owner and a deadline: one merge or split runs at a time (under the role changes' lock), an
actor that does not answer SetCores in time is killed (its supervisor restarts it on its own cores), and when the
widened actor goes down its parked peers take work again at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from actors.supervisor import ActorHandle, ActorState, Supervisor
from router.failover import Failover
from router.roles import RoleChanges, ask
from transport import messages as m

log = logging.getLogger("router")


class MergeFailed(RuntimeError):
    """The survivor could not be told, went down, or did not answer in time."""


@dataclass(frozen=True)
class CoreShare:
    threads: int
    cpus: tuple[int, ...]


def own_share(handle: ActorHandle) -> CoreShare:
    return CoreShare(handle.spec.threads, handle.spec.cpus)


def merged_share(handles: list[ActorHandle]) -> CoreShare:
    """The threads and cores of `handles` together."""
    return CoreShare(sum(h.spec.threads for h in handles), tuple(sorted({c for h in handles for c in h.spec.cpus})))


def mergeable(handles: list[ActorHandle]) -> bool:
    """Whether these actors' cores can go to one of them: local CPU actors, each pinned to cores no other holds."""
    cpus = [c for h in handles for c in h.spec.cpus]
    return len(handles) >= 2 and all(h.spec.device == "cpu" and not h.spec.remote and h.spec.cpus for h in handles) \
        and len(cpus) == len(set(cpus))


class CoreMerges:
    def __init__(self, supervisor: Supervisor, failover: Failover, roles: RoleChanges, timeout: float) -> None:
        self.supervisor, self.failover, self.roles, self.timeout = supervisor, failover, roles, timeout
        self.pending: dict[str, asyncio.Future] = {}
        self.merges = self.splits = self.failures = 0

    @property
    def survivor(self) -> ActorHandle | None:
        return next((h for h in self.supervisor.handles if h.widened is not None), None)

    def parked(self) -> list[ActorHandle]:
        return [h for h in self.supervisor.handles if h.parked]

    async def merge(self, survivor: ActorHandle, others: list[ActorHandle], reason: str) -> bool:
        """Park `others` and widen `survivor` onto their cores (False when the survivor failed to widen: the
        others take work again)."""
        async with self.roles.lock:
            started = time.monotonic()
            moved = 0
            for handle in others:
                handle.parked = True
                moved += self.failover.move_off(handle)
            share = merged_share([survivor, *others])
            log.info("merging %s onto %s's cores: %d threads on cores %s (%d requests moved): %s",
                     ", ".join(h.actor_id for h in others), survivor.actor_id, share.threads, list(share.cpus), moved,
                     reason, extra={"actor_id": survivor.actor_id, "reason": reason})
            try:
                await self._set(survivor, share)
            except MergeFailed as exc:
                self.failures += 1
                log.error("merge onto %s failed: %s; the parked actors serve again", survivor.actor_id, exc)
                self.unpark()
                return False
            survivor.widened = share.cpus
            self.merges += 1
            log.info("%s runs on cores %s, %.2fs after the merge began", survivor.actor_id, list(share.cpus),
                     time.monotonic() - started, extra={"actor_id": survivor.actor_id})
            return True

    async def split(self, reason: str) -> bool:
        """Narrow the survivor back to its own cores, then let the parked actors take work again (they do even
        when the survivor failed to answer: it is then restarted on its own cores)."""
        async with self.roles.lock:
            survivor = self.survivor
            try:
                if survivor is not None and survivor.state is ActorState.READY:
                    await self._set(survivor, own_share(survivor))
                    self.splits += 1
                    log.info("split: %s runs on its own cores %s again: %s", survivor.actor_id,
                             list(survivor.spec.cpus), reason, extra={"actor_id": survivor.actor_id})
            except MergeFailed as exc:
                self.failures += 1
                log.error("split: %s did not narrow (%s)", survivor.actor_id, exc)
                return False
            finally:
                if survivor is not None:
                    survivor.widened = None
                self.unpark()
            return True

    def unpark(self) -> None:
        for handle in self.parked():
            handle.parked = False
        self.failover.unpark()

    async def _set(self, handle: ActorHandle, share: CoreShare) -> None:
        """SetCores, answered within the deadline (else the actor is killed: it restarts on its own cores)."""
        sent = handle.send(m.SetCores(share.threads, list(share.cpus)))
        await ask(self.supervisor, self.pending, handle, sent, self.timeout, "change cores", MergeFailed)

    def on_cores_set(self, handle: ActorHandle, msg: m.CoresSet) -> None:
        future = self.pending.get(handle.actor_id)
        if future is None or future.done():
            return
        if msg.error:
            future.set_exception(MergeFailed(f"{handle.actor_id} refused: {msg.error}"))
        else:
            future.set_result(msg)

    def on_down(self, handle: ActorHandle) -> None:
        """A widened actor that goes down comes back on its own cores: its parked peers serve again now."""
        future = self.pending.get(handle.actor_id)
        if future is not None and not future.done():
            future.set_exception(MergeFailed(f"{handle.actor_id} went down"))
        if handle.widened is not None:
            handle.widened = None
            log.warning("%s, widened onto its parked peers' cores, went down: they serve again", handle.actor_id)
            self.unpark()

    def status(self) -> dict:
        survivor = self.survivor
        return {"merges": self.merges, "splits": self.splits, "failed": self.failures,
                "widened": None if survivor is None else {"actor": survivor.actor_id, "cpus": list(survivor.widened)},
                "parked": [h.actor_id for h in self.parked()]}
