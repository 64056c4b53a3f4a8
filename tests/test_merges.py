"""Merging actors' cores, the router's side, against fake actors: a merge parks the others and widens the survivor,
a split narrows it and unparks them; a survivor that refuses, never answers (killed, to restart on its own cores)
or goes down leaves no actor parked. Which actors' cores can merge at all."""
from __future__ import annotations

import asyncio

import pytest

from actors.spec import ActorSpec, Role
from actors.supervisor import ActorHandle, ActorState
from router.merges import CoreMerges, merged_share, mergeable
from transport import messages as m


class FakeActors:
    """The supervisor's side: handles whose sends are recorded, and answered by `answer` (None: never)."""

    def __init__(self, answer: str | None = "") -> None:
        self.handles = [self._handle("decode-0", Role.DECODE, (0,)), self._handle("prefill-0", Role.PREFILL, (1,))]
        self.answer, self.sent, self.killed = answer, [], []
        self.merges: CoreMerges | None = None

    def _handle(self, actor_id: str, role: Role, cpus: tuple[int, ...]) -> ActorHandle:
        handle = ActorHandle(ActorSpec(actor_id, role, threads=len(cpus), cpus=cpus), ActorState.READY)

        async def send(msg: m.Message) -> bool:
            self.sent.append((actor_id, msg))
            if isinstance(msg, m.SetCores) and self.answer is not None:
                reply = m.CoresSet(actor_id, msg.threads, msg.cpus, 0.001, self.answer)
                asyncio.get_running_loop().call_soon(self.merges.on_cores_set, handle, reply)
            return True

        handle.send = send
        return handle

    def by_id(self, actor_id: str) -> ActorHandle:
        return next(h for h in self.handles if h.actor_id == actor_id)

    def kill(self, actor_id: str) -> None:
        self.killed.append(actor_id)


class FakeFailover:
    def __init__(self) -> None:
        self.moved, self.unparked = [], 0

    def move_off(self, handle: ActorHandle) -> int:
        self.moved.append(handle.actor_id)
        return 2

    def unpark(self) -> None:
        self.unparked += 1


class FakeRoles:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()


def setup(answer: str | None = "", timeout: float = 5.0) -> tuple[FakeActors, FakeFailover, CoreMerges]:
    actors, failover = FakeActors(answer), FakeFailover()
    actors.merges = CoreMerges(actors, failover, FakeRoles(), timeout)
    return actors, failover, actors.merges


async def test_a_merge_parks_the_others_and_a_split_gives_the_cores_back_first():
    actors, failover, merges = setup()
    decode, prefill = actors.handles
    assert await merges.merge(decode, [prefill], "test")
    assert prefill.parked and not decode.parked and decode.widened == (0, 1) and merges.survivor is decode
    assert failover.moved == ["prefill-0"]  # what it held went elsewhere first
    assert actors.sent == [("decode-0", m.SetCores(2, [0, 1]))]
    assert merges.status() == {"merges": 1, "splits": 0, "failed": 0, "widened": {"actor": "decode-0", "cpus": [0, 1]},
                               "parked": ["prefill-0"]}
    assert await merges.split("test")
    assert actors.sent[-1] == ("decode-0", m.SetCores(1, [0]))
    assert not prefill.parked and decode.widened is None and merges.survivor is None and failover.unparked == 1
    assert merges.status()["splits"] == 1 and merges.status()["parked"] == []


async def test_a_survivor_that_refuses_leaves_the_others_serving():
    actors, failover, merges = setup(answer="the actor is changing role")
    decode, prefill = actors.handles
    assert not await merges.merge(decode, [prefill], "test")
    assert not prefill.parked and decode.widened is None and merges.failures == 1 and actors.killed == []


async def test_a_survivor_that_never_answers_is_killed_and_the_others_serve():
    actors, _, merges = setup(answer=None, timeout=0.05)
    decode, prefill = actors.handles
    assert not await merges.merge(decode, [prefill], "test")
    assert actors.killed == ["decode-0"] and not prefill.parked and decode.widened is None
    assert merges.pending == {}


async def test_a_widened_actor_that_goes_down_unparks_its_peers():
    actors, failover, merges = setup()
    decode, prefill = actors.handles
    assert await merges.merge(decode, [prefill], "test")
    merges.on_down(prefill)  # a parked actor going down changes nothing
    assert prefill.parked and decode.widened == (0, 1)
    merges.on_down(decode)
    assert not prefill.parked and decode.widened is None and failover.unparked == 1


async def test_a_split_after_the_survivor_went_down_only_unparks():
    actors, _, merges = setup()
    decode, prefill = actors.handles
    assert await merges.merge(decode, [prefill], "test")
    decode.state = ActorState.STARTING
    assert await merges.split("test")
    assert actors.sent == [("decode-0", m.SetCores(2, [0, 1]))] and not prefill.parked


@pytest.mark.parametrize("specs, expected", [
    ([("cpu", (0,), False), ("cpu", (1,), False)], True),
    ([("cpu", (0, 1), False), ("cpu", (2, 3), False)], True),
    ([("cpu", (0,), False)], False),  # nothing to merge with
    ([("cpu", (0,), False), ("cpu", (0,), False)], False),  # one core shared: nothing to lend
    ([("cpu", (), False), ("cpu", (), False)], False),  # not pinned (on Ray)
    ([("cpu", (0,), False), ("cpu", (1,), True)], False),  # one on another host
    ([("cuda:0", (0,), False), ("cuda:1", (1,), False)], False),
])
def test_only_local_cpu_actors_on_cores_of_their_own_merge(specs, expected):
    handles = [ActorHandle(ActorSpec(f"decode-{i}", Role.DECODE, device, cpus=cpus, remote=remote))
               for i, (device, cpus, remote) in enumerate(specs)]
    assert mergeable(handles) is expected


def test_the_merged_share_adds_threads_and_cores():
    handles = [ActorHandle(ActorSpec("a", Role.DECODE, threads=2, cpus=(2, 3))),
               ActorHandle(ActorSpec("b", Role.PREFILL, threads=1, cpus=(0,)))]
    share = merged_share(handles)
    assert (share.threads, share.cpus) == (3, (0, 2, 3))


async def test_no_merged_actor_changes_role_until_the_cores_are_split():
    from router.roles import RoleChanges

    actors, failover, merges = setup()
    decode, prefill = actors.handles
    roles = RoleChanges(actors, failover, None, share_kv=True, timeout=1.0, default_seconds=1.0)
    assert await merges.merge(decode, [prefill], "test")
    assert roles.refusal(decode, Role.PREFILL) == "decode-0 runs on merged cores: split them first"
    assert roles.refusal(prefill, Role.DECODE) == "prefill-0 lends merged cores: split them first"
    assert await merges.split("test")
    assert roles.refusal(prefill, Role.DECODE) is None
