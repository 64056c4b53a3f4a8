"""Each role's actor class, and the change of a prefill or decode actor's role in its running process.

A change (router -> ChangeRole, sent once the router has moved every request off the actor) stops the engine of
the old role, builds the engine of the new role around the model the process has loaded (engine.core.builder's
`loaded`: no checkpoint is read, the weights keep their prepared copies) and answers RoleChanged with the Ready it
would have sent at start in that role. The process keeps its cores, its socket and its connections; only the
object that plays the role is new (actors/actor.py, `Actor.current`). The new engine is built on a thread that
exits before stepping starts, as at start (engine/core/engine_thread.py). A change that fails leaves no engine to
serve with: the actor says Error and stops, and its supervisor restarts it in its old role.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from actors.actor import Actor, send_quietly
from actors.decode_actor import DecodeActor
from actors.draft_actor import DraftActor
from actors.prefill_actor import PrefillActor
from actors.spec import ActorSpec, Role
from engine.core.builder import LoadedModel
from engine.core.engine_thread import EngineThread, build_in_thread
from transport import Connection
from transport import messages as m

log = logging.getLogger("actor")

ACTOR_CLASSES: dict[Role, type[Actor]] = {Role.DECODE: DecodeActor, Role.PREFILL: PrefillActor, Role.DRAFT: DraftActor}
SWITCHABLE = frozenset({Role.PREFILL, Role.DECODE})  # the roles an actor may change between


def make_actor(spec: ActorSpec) -> Actor:
    """The actor a worker process runs: a prefill or decode actor can change role later."""
    cls = ACTOR_CLASSES[Role(spec.role)]
    return cls(spec, change_role) if spec.role in SWITCHABLE else cls(spec)


async def change_role(process: Actor, conn: Connection, msg: m.ChangeRole) -> None:
    """The ChangeRole handler of a prefill or decode actor's process (`process`: the object the worker made)."""
    refusal = _refusal(process, msg.role)
    if refusal is not None:
        await send_quietly(conn, m.Error(refusal))
        return
    role, old = Role(msg.role), process.current
    if role is old.spec.role:  # nothing to change: say so, with the Ready it serves under
        await send_quietly(conn, m.RoleChanged(process.spec.actor_id, role.value, old.ready_message()))
        return
    started = time.monotonic()
    process.changing = True
    try:
        new = await _successor(process, old, role, msg)
    except Exception as exc:  # noqa: BLE001 - whatever failed, no engine serves now: stop, to be restarted
        log.exception("changing role to %s failed; stopping (the supervisor restarts this actor)", role)
        await send_quietly(conn, m.Error(f"changing role to {role} failed: {type(exc).__name__}: {exc}"))
        process.stopped.set()
        return
    finally:
        process.changing = False
    seconds = time.monotonic() - started
    log.info("actor %s changed role %s -> %s in %.2fs (%s)", process.spec.actor_id, old.spec.role, role, seconds,
             new.startup.summary(), extra={"role": role.value, "seconds": round(seconds, 3)})
    changed = m.RoleChanged(process.spec.actor_id, role.value, new.ready_message(), seconds)
    for peer in list(process.connections):
        await send_quietly(peer, changed)


def _refusal(process: Actor, role: str) -> str | None:
    if role not in {r.value for r in SWITCHABLE}:
        return f"an actor changes role between prefill and decode only, not to {role!r}"
    if process.changing:
        return "this actor is changing role already"
    return None


async def _successor(process: Actor, old: Actor, role: Role, msg: m.ChangeRole) -> Actor:
    """Retire the old role's engine, then build and start the new one around the same model."""
    loaded = await _retire(old)
    spec = replace(old.spec, role=role, share_kv=msg.share_kv, calibration=msg.calibration)
    new = ACTOR_CLASSES[role](spec)
    new.loop, new.loaded = process.loop, loaded
    engine = await build_in_thread(new.build_engine, f"{spec.actor_id}-{role}")
    new.loaded = None
    new.thread = EngineThread(engine, process.loop, new.deliver, new._on_step_error, name=spec.actor_id)
    new.start_tasks()
    process.current = new
    old.engine = None  # its pools go with it; the model lives on in the new engine
    return new


async def _retire(old: Actor) -> LoadedModel:
    """Stop the old role: the engine calls queued before ChangeRole run first (aborts of the requests the router
    moved off), any request still owned is failed as retryable, the step thread ends and the role's resources
    (its exported pool, its KV streams) are released. Returns the model to build the next engine around."""
    await old.thread.submit(lambda engine: None)
    for request_id in list(old.owners):
        old.send_to_owner(request_id, m.RequestFailed(request_id, "the actor is changing role", True), finished=True)
    old.thread.shutdown()
    for task in old.tasks:
        task.cancel()
    old.release()
    return LoadedModel.of(old.engine)
