"""Actors that change role, on real actor processes with the tiny model: a prefill and a decode actor switch roles
back and forth under streaming load and every stream ends with the text a static layout gives, with no block
left behind; a decode actor that is lost hands its role to the prefill actor (degrade instead of fail), which
goes back to prefilling once the decode actor serves again, or keeps the role when it never comes back; a merge
puts the decode actor on both actors' cores and a split gives them back, under the same load."""
from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest
import pytest_asyncio

from actors.spec import Role
from engine import LLM, AsyncLLM, SamplingParams
from engine.core.stats import EngineStats
from server.metrics import ServerMetrics
from tests.test_actors import OPTIONS, assert_clean, references, stream_tokens, wait_for
from tests.test_engine import make_prompts

on_module_loop = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 300


def workload(seed: int, count: int = 8) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy streams and seeded sampled ones (their draws are keyed by position: a moved stream redraws the same)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed + i, ignore_eos=True)
              for i in range(count // 4)]
    return make_prompts(count, seed=seed), [greedy] * (count - len(seeded)) + seeded


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tiny_model_dir):
    """One prefill and one decode actor; every request that can be handed off is."""
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always", **OPTIONS)
    await llm.start()
    yield llm
    await llm.aclose()


class Streams:
    """Streams running against the server, and what a static layout answers them."""

    def __init__(self, llm: AsyncLLM, prompts: list[list[int]], params: list[SamplingParams],
                 expected: list[list[int]]) -> None:
        self.expected = expected
        self.progress = [0] * len(prompts)
        self.tasks = [asyncio.create_task(stream_tokens(llm, p, sp, self.progress, i))
                      for i, (p, sp) in enumerate(zip(prompts, params))]

    @staticmethod
    async def started(llm: AsyncLLM, wave: tuple) -> "Streams":
        """Once each stream of the wave (from `waves`) has its first tokens."""
        streams = Streams(llm, *wave)
        await wait_for(lambda: min(streams.progress) >= 3, 60, "every stream to start")
        return streams

    async def outputs(self) -> list[list[int]]:
        return await asyncio.wait_for(asyncio.gather(*self.tasks), 180)


async def waves(reference: LLM, *seeds: int) -> list[tuple]:
    """(prompts, params, what a static layout answers) per seed, run off the loop: heartbeats go on."""
    def run() -> list[tuple]:
        return [(*w, references(reference, *w)) for w in map(workload, seeds)]

    return await asyncio.to_thread(run)


def roles(llm: AsyncLLM) -> dict[str, str]:
    return {h.actor_id: h.spec.role.value for h in llm._client.supervisor.handles}


@on_module_loop
async def test_streams_are_unchanged_by_repeated_role_changes(pair, reference):
    router = pair._client
    pids = {h.actor_id: h.pid for h in router.supervisor.handles}
    wave = await waves(reference, 500, 510, 520)
    first = await Streams.started(pair, wave[0])
    assert await router.roles.change("prefill-0", Role.DECODE, "test: colocate")
    assert roles(pair) == {"prefill-0": "decode", "decode-0": "decode"} and pair.layout_status()["current"] == "0P+2D"
    second = await Streams.started(pair, wave[1])  # placed on either decode actor, colocated
    assert await router.roles.change("decode-0", Role.PREFILL, "test: the roles swapped")  # its streams move
    assert roles(pair) == {"prefill-0": "decode", "decode-0": "prefill"}
    third = await Streams.started(pair, wave[2])  # handed off from decode-0 to prefill-0
    assert await router.roles.change("decode-0", Role.DECODE, "test: colocate again")
    assert await router.roles.change("prefill-0", Role.PREFILL, "test: back to the start")
    assert roles(pair) == {"prefill-0": "prefill", "decode-0": "decode"} and pair.layout_status()["current"] == "1P+1D"
    for streams in (first, second, third):
        assert await streams.outputs() == streams.expected
    with pytest.raises(ValueError, match="last decode actor"):
        await router.roles.change("decode-0", Role.PREFILL, "test: never without a decode actor")
    assert {h.actor_id: h.pid for h in router.supervisor.handles} == pids  # no process was restarted
    counters = router.counters()
    assert (counters["role_changes"], counters["failed_role_changes"]) == (4, 0)
    assert counters["migrations"] >= 1 and counters["failed_migrations"] == 0
    recent = pair.layout_status()["roles"]["recent"]
    assert [(r["actor"], r["to"], r["ok"]) for r in recent] == [
        ("prefill-0", "decode", True), ("decode-0", "prefill", True), ("decode-0", "decode", True),
        ("prefill-0", "prefill", True)]
    assert recent[1]["moved_requests"] >= 1  # decode-0 held streams when it became a prefill actor
    await assert_clean(pair)
    body = ServerMetrics(EngineStats, "tiny", layout=pair.layout_status).render().decode()
    assert 'layout_seconds_total{layout="0P+2D",model_name="tiny"}' in body
    assert 'phase_serve:layout{layout="1P+1D",model_name="tiny"} 1.0' in body


def allowed_cpus(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets the threads of process `pid` may run on."""
    sets = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            sets.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            pass
    return sets


@on_module_loop
async def test_a_merge_gives_the_decode_actor_every_core_and_a_split_gives_them_back(pair, reference):
    router = pair._client
    decode, prefill = router.supervisor.by_id("decode-0"), router.supervisor.by_id("prefill-0")
    pids, own = {h.actor_id: h.pid for h in router.supervisor.handles}, frozenset(decode.spec.cpus)
    assert allowed_cpus(decode.pid) == {own}
    wave = await waves(reference, 560, 570)
    first = await Streams.started(pair, wave[0])  # handed off from prefill-0
    assert await router.merges.merge(decode, [prefill], "test: merge")
    assert allowed_cpus(decode.pid) == {own | set(prefill.spec.cpus)}
    status = pair.layout_status()
    assert status["current"] == "0P+1D*2" and status["merges"]["parked"] == ["prefill-0"]
    assert status["merges"]["widened"] == {"actor": "decode-0", "cpus": sorted(own | set(prefill.spec.cpus))}
    transfers = router.counters()["kv_transfers"]
    second = await Streams.started(pair, wave[1])  # prefill-0 is parked: every prompt prefills on decode-0
    assert router.counters()["kv_transfers"] == transfers
    assert await router.merges.split("test: split")
    assert allowed_cpus(decode.pid) == {own} and not prefill.parked and decode.widened is None
    for streams in (first, second):
        assert await streams.outputs() == streams.expected
    assert pair.layout_status()["current"] == "1P+1D"
    assert {h.actor_id: h.pid for h in router.supervisor.handles} == pids
    await assert_clean(pair)


@on_module_loop
async def test_the_parked_actor_serves_again_when_the_widened_actor_dies(pair, reference):
    router = pair._client
    decode, prefill = router.supervisor.by_id("decode-0"), router.supervisor.by_id("prefill-0")
    assert await router.merges.merge(decode, [prefill], "test: merge")
    streams = await Streams.started(pair, (await waves(reference, 580))[0])
    os.kill(decode.pid, signal.SIGKILL)
    await wait_for(lambda: not prefill.parked, 10, "the parked actor to take work again")
    assert decode.widened is None and pair.layout_status()["merges"]["parked"] == []
    assert await streams.outputs() == streams.expected
    await wait_for(lambda: decode.state == "ready" and roles(pair) == {"prefill-0": "prefill", "decode-0": "decode"},
                   120, "the decode actor back on its own cores")
    assert allowed_cpus(decode.pid) == {frozenset(decode.spec.cpus)}
    await assert_clean(pair)


@on_module_loop
async def test_a_stand_in_decodes_while_the_decode_actor_restarts_then_goes_back(pair, reference):
    """The decode actor's restart is slow: after degrade_after the prefill actor takes the decode role, serves,
    and becomes a prefill actor again once the decode actor is back."""
    router = pair._client
    router.degrade.settings = replace(router.degrade.settings, degrade_after=0.5)
    router.supervisor.settings = replace(router.supervisor.settings, restart_backoff=(3.0,))
    decode = router.supervisor.by_id("decode-0")
    streams = await Streams.started(pair, (await waves(reference, 530))[0])
    os.kill(decode.pid, signal.SIGKILL)
    assert await streams.outputs() == streams.expected
    await wait_for(lambda: decode.state == "ready" and roles(pair) == {"prefill-0": "prefill", "decode-0": "decode"},
                   120, "the decode actor back and the stand-in prefilling again")
    reasons = [r["reason"] for r in pair.layout_status()["roles"]["recent"]]
    assert reasons[-2].startswith("degrade: no decode actor serves: decode-0 down")
    assert reasons[-1] == "restore: a decode actor serves again"
    await assert_clean(pair)


@on_module_loop
async def test_a_crash_looping_decode_actor_leaves_its_role_to_the_prefill_actor(pair, reference):
    """Its restarts are used up: no decode actor will come back, and requests are served colocated by the former
    prefill actor instead of failing."""
    router = pair._client
    router.supervisor.settings = replace(router.supervisor.settings, crash_loop_restarts=0)
    decode = router.supervisor.by_id("decode-0")
    streams = await Streams.started(pair, (await waves(reference, 540))[0])
    os.kill(decode.pid, signal.SIGKILL)
    assert await streams.outputs() == streams.expected  # moved to the stand-in mid-stream
    assert decode.state == "failed" and roles(pair)["prefill-0"] == "decode"
    assert pair.layout_status()["degrade"]["stand_ins"] == ["prefill-0"] and pair.layout_status()["current"] == "0P+1D"
    prompt = make_prompts(1, seed=550)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = [out async for out in pair.generate(prompt, params)]
    assert outputs[-1].token_ids == (await asyncio.to_thread(reference.generate, [prompt], params))[0].token_ids
    assert outputs[-1].placement.startswith("colocated; decode=prefill-0;")
    await assert_clean(pair)
