"""Streams that outlive their decode actor, on real actor processes: killed (kill -9) or drained, every stream
moves to the other decode actor (or to its own replacement) and ends with the uninterrupted run's text; a
client leaving mid-move frees everything; with no decode actor coming back the stream ends with a clear error
in bounded time. Over HTTP: POST /admin/drain and SIGTERM to one actor."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import replace

import pytest
import pytest_asyncio

from engine import LLM, AsyncLLM, SamplingParams
from engine.core.client_protocol import RequestFailedError
from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server, wait_until
from tests.test_actors import OPTIONS, assert_clean, references, stream_tokens, wait_for
from tests.test_engine import make_prompts

MAX_TOKENS = 160
GREEDY_LONG = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """8 greedy and 4 seeded sampled streams."""
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed + i, ignore_eos=True)
              for i in range(4)]
    return make_prompts(12, seed=seed), [GREEDY_LONG] * 8 + seeded


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair(tiny_model_dir):
    """Two colocated decode actors."""
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=2, **OPTIONS)
    await llm.start()
    yield llm
    await llm.aclose()


on_module_loop = pytest.mark.asyncio(loop_scope="module")


def busiest(llm: AsyncLLM):
    """The decode actor holding the most streams, and how many it holds."""
    router = llm._client
    counts = {h.actor_id: 0 for h in router.supervisor.ready("decode")}
    for routed in router.routed.values():
        if routed.decode in counts:
            counts[routed.decode] += 1
    actor_id = max(counts, key=counts.get)
    return router.supervisor.by_id(actor_id), counts[actor_id]


async def run_and_disrupt(llm: AsyncLLM, reference: LLM, seed: int, disrupt) -> None:
    prompts, params = workload(seed)
    expected = await asyncio.to_thread(references, reference, prompts, params)  # off the loop: heartbeats go on
    progress = [0] * len(prompts)
    tasks = [asyncio.create_task(stream_tokens(llm, p, sp, progress, i))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    await wait_for(lambda: min(progress) >= 3, 30, "every stream to start")
    await disrupt()
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert outs == expected


@on_module_loop
async def test_killed_decode_actor_streams_move_to_the_survivor(pair, reference):
    router = pair._client
    before = router.counters()["migrations"]
    victim = None

    async def kill():
        nonlocal victim
        victim, held = busiest(pair)
        assert held > 0
        os.kill(victim.pid, signal.SIGKILL)

    await run_and_disrupt(pair, reference, 300, kill)
    assert router.counters()["migrations"] > before
    assert router.counters()["failed_migrations"] == 0
    await wait_for(lambda: victim.state == "ready", 60, "the killed actor's replacement")
    await assert_clean(pair)


@on_module_loop
async def test_drain_moves_streams_and_restarts_the_actor(pair, reference):
    router = pair._client
    drained = None

    async def drain():
        nonlocal drained
        drained, held = busiest(pair)
        assert await pair.drain(drained.actor_id) == held > 0

    restarts = None

    async def drain_and_count():
        nonlocal restarts
        await drain()
        restarts = drained.restarts

    await run_and_disrupt(pair, reference, 310, drain_and_count)
    await wait_for(lambda: drained.state == "ready" and drained.restarts == restarts + 1, 60, "the restart")
    assert drained.last_exit == 0  # it stopped cleanly when told to, after its streams had moved
    assert not drained.draining
    await assert_clean(pair)
    with pytest.raises(KeyError):
        await pair.drain("decode-9")


@on_module_loop
async def test_client_leaving_during_a_migration_frees_every_block(pair, reference):
    router = pair._client
    prompts, params = workload(320)
    progress = [0] * len(prompts)
    tasks = [asyncio.create_task(stream_tokens(pair, p, sp, progress, i))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    await wait_for(lambda: min(progress) >= 3, 30, "every stream to start")
    victim, _ = busiest(pair)
    (survivor,) = [h for h in router.supervisor.ready("decode") if h is not victim]
    os.kill(survivor.pid, signal.SIGSTOP)  # the moved streams queue on it, mid-migration
    try:
        os.kill(victim.pid, signal.SIGKILL)
        await wait_for(lambda: victim.state != "ready", 10, "the death to be noticed")
        await wait_for(lambda: any(r.migrations for r in router.routed.values()), 10, "a migration")
        for task in tasks:
            task.cancel()
    finally:
        os.kill(survivor.pid, signal.SIGCONT)
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: victim.state == "ready", 60, "the killed actor's replacement")
    await assert_clean(pair)


@on_module_loop
async def test_no_decode_actor_coming_back_ends_the_stream_with_a_clear_error(pair, reference):
    """Both decode actors die and cannot start again (a crash loop): every migration waits for one, and the
    stream ends with an error that says so within the park deadline: no hang."""
    router = pair._client
    router.failover.park_timeout = 3.0
    progress = [0]
    task = asyncio.create_task(stream_tokens(pair, make_prompts(1, seed=330)[0], GREEDY_LONG, progress, 0))
    await wait_for(lambda: progress[0] >= 3, 30, "the stream to start")
    for handle in router.supervisor.handles:
        handle.spec = replace(handle.spec, engine={**handle.spec.engine, "model": "/nonexistent/model"})
        os.kill(handle.pid, signal.SIGKILL)
    with pytest.raises(RequestFailedError, match="no decode actor became available"):
        await asyncio.wait_for(task, 30)
    assert router.counters()["failed_migrations"] >= 1
    assert not router.routed


# ---------------------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("migration") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", "tiny", "--decode-actors", "1",
                        "--api-key", "sekrit")
    yield proc
    assert proc.stop() == 0


def decode_actor(server) -> dict:
    status = server.get("/status", headers=AUTH).json()
    return next(a for a in status["actors"] if a["role"] == "decode")


AUTH = {"Authorization": "Bearer sekrit"}
PROMPTS = ["Tell me a long story about", "The history of the", "Write a poem about the sea and",
           "List the numbers", "Once upon a time"]


def streams_across(server, disrupt) -> tuple[list[str], list[str]]:
    """(whole greedy answers, the same prompts streamed while `disrupt()` runs mid-reply)."""
    client = openai_client(server)
    client.api_key = "sekrit"
    ask = dict(model="tiny", max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
    whole = [client.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    chunks: list[list[str]] = [[] for _ in PROMPTS]
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            for event in client.completions.create(prompt=PROMPTS[i], stream=True, **ask):
                chunks[i].append(event.choices[0].text if event.choices else "")
        except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    assert wait_until(lambda: all(len(c) >= 3 for c in chunks), 30)
    disrupt()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return whole, ["".join(c) for c in chunks]


def test_admin_drain_needs_the_key_and_names_the_actor(server):
    assert server.post("/admin/drain?actor=decode-0", b"").status == 401
    missing = server.post("/admin/drain", b"", headers=AUTH)
    assert missing.status == 400 and missing.json()["error"]["param"] == "actor"
    unknown = server.post("/admin/drain?actor=nope", b"", headers=AUTH)
    assert unknown.status == 404 and unknown.json()["error"]["code"] == "actor_not_found"


def test_admin_drain_of_a_busy_actor_keeps_every_stream_intact(server):
    before = decode_actor(server)
    answer = {}

    def drain() -> None:
        answer.update(server.post("/admin/drain?actor=decode-0", b"", headers=AUTH).json())

    whole, streamed = streams_across(server, drain)
    assert streamed == whole
    assert answer["moved_requests"] >= 1
    assert wait_until(lambda: decode_actor(server)["restarts"] == before["restarts"] + 1
                      and decode_actor(server)["state"] == "ready", 60)
    after = decode_actor(server)
    assert after["last_exit"] == 0 and after["pid"] != before["pid"]
    assert 'phase_serve:migrations_total{model_name="tiny"}' in server.get("/metrics").body.decode()
    assert '"migrated": "decode-0->decode-0"' in server.log()


def test_sigterm_to_one_actor_moves_its_streams_before_it_stops(server):
    before = decode_actor(server)
    whole, streamed = streams_across(server, lambda: os.kill(before["pid"], signal.SIGTERM))
    assert streamed == whole
    assert wait_until(lambda: decode_actor(server)["pid"] != before["pid"]
                      and decode_actor(server)["state"] == "ready", 60)
    assert decode_actor(server)["last_exit"] == 0
    assert "actor decode-0 was asked to stop" in server.log()  # the planned path: moved first, then stopped
