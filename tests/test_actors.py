"""Actor subprocesses end to end on the tiny model: hand-off correctness, failover, hostile input."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import pytest_asyncio

from engine import LLM, AsyncLLM, SamplingParams
from tests.server_utils import guarded, wait_for
from tests.test_engine import GREEDY, make_prompts
from transport.owned import owned_prefix

pytestmark = pytest.mark.asyncio(loop_scope="module")
OPTIONS = dict(dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always", **OPTIONS)
    await llm.start()
    yield llm
    decodes = [h for h in llm._client.supervisor.handles if h.spec.role == "decode"]
    assert all(h.ready.kv_export["kind"] == "shm" and h.ready.kv_export["socket"] for h in decodes)
    assert [h.ready.step_tokens for h in decodes] == [OPTIONS["max_num_batched_tokens"]]  # for placement
    pids = [h.pid for h in decodes]
    await llm.aclose()
    left = [p for pid in pids for p in Path("/dev/shm").glob(f"{owned_prefix('kv', pid)}*")]
    assert not left, "a shared KV pool outlived its actor"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


async def generate(llm: AsyncLLM, prompt, params=GREEDY) -> list[int]:
    token_ids: list[int] = []
    async for out in llm.generate(prompt, params):
        token_ids = out.token_ids
    return token_ids



async def assert_clean(llm: AsyncLLM) -> None:
    """No leaked blocks or reservations on any live decode actor once the work is done."""
    router = llm._client
    await wait_for(lambda: not router.routed, 10, "the router to forget finished requests")
    for handle in router.supervisor.ready("decode"):
        report = await router.integrity.check(handle.actor_id)
        assert report.error is None, report.error
        assert (report.used_blocks, report.reservations, report.running) == (0, 0, 0), report


async def test_disaggregated_outputs_equal_colocated(cluster, reference):
    prompts = make_prompts(8, seed=41)
    outs = await asyncio.gather(*(generate(cluster, p) for p in prompts))
    assert outs == [o.token_ids for o in reference.generate(prompts, GREEDY)]
    assert cluster._client.handoff.counters.kv_transfers >= 8
    await assert_clean(cluster)


async def test_samples_finishing_in_one_step_all_arrive(cluster, reference):
    """n samples that finish in the same step each send their last row (the request's owner outlives the
    step's rows), so an n > 1 request ends, with the in-process engine's samples."""
    prompt = make_prompts(1, seed=40)[0]
    for n in (2, 4):
        params = SamplingParams(max_tokens=5, temperature=1.0, seed=9, n=n)
        last = None
        async for out in cluster.generate(prompt, params):
            last = out
        assert last.finished and [o.finish_reason for o in last.outputs] == ["length"] * n
        expected = await asyncio.to_thread(reference.generate, [prompt], params)
        assert [o.token_ids for o in last.outputs] == [o.token_ids for o in expected[0].outputs]
    await assert_clean(cluster)


async def test_only_missing_blocks_move_on_a_prefix_hit(cluster, reference):
    router = cluster._client
    decode = router.supervisor.ready("decode")[0].ready
    bytes_per_block = decode.kv_export["bytes_per_token"] * decode.block_size
    shared = make_prompts(1, seed=42)[0] * 2
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
    assert await generate(cluster, first) == reference.generate([first], GREEDY)[0].token_ids
    before = router.handoff.counters.kv_bytes_transferred
    assert await generate(cluster, second) == reference.generate([second], GREEDY)[0].token_ids
    total_blocks = -(-len(second) // 8)
    cached_blocks = len(shared) // 8
    assert router.handoff.counters.kv_bytes_transferred - before == (total_blocks - cached_blocks) * bytes_per_block
    await assert_clean(cluster)


async def test_garbage_on_an_actor_socket_leaves_it_serving(cluster, reference):
    handle = cluster._client.supervisor.ready("decode")[0]
    # a whole frame of random bytes, then a header past the frame limit (a random header alone may announce a
    # legal size larger than what follows, and the actor rightly waits for the rest of that frame)
    garbage = os.urandom(4096)
    for payload in (len(garbage).to_bytes(4, "big") + garbage, (2 ** 31).to_bytes(4, "big") + b"x" * 64):
        reader, writer = await asyncio.open_unix_connection(handle.spec.socket_path)
        writer.write(payload)
        await writer.drain()
        await asyncio.wait_for(reader.read(), guarded(10))  # the actor closes this connection (after its greeting)
        writer.close()
    prompt = make_prompts(1, seed=43)[0]
    assert await generate(cluster, prompt) == reference.generate([prompt], GREEDY)[0].token_ids
    assert handle.state == "ready" and handle.restarts == 0


async def test_prefill_actor_killed_mid_prefill_falls_back_to_colocated(cluster, reference):
    router = cluster._client
    prompt = make_prompts(1, seed=44, vocab=512)[0] * 12  # hundreds of tokens: many prefill chunks
    prefill = router.supervisor.ready("prefill")[0]
    restarts = prefill.restarts
    os.kill(prefill.pid, signal.SIGSTOP)  # freeze it so the kill lands while its prefill is in flight
    task = asyncio.create_task(generate(cluster, prompt))
    await wait_for(lambda: any(r.phase == "prefilling" for r in router.routed.values()), 20, "a prefill")
    os.kill(prefill.pid, signal.SIGKILL)
    assert await task == reference.generate([prompt], GREEDY)[0].token_ids
    await assert_clean(cluster)
    await wait_for(lambda: prefill.state == "ready" and prefill.restarts == restarts + 1, 30, "the restart")


async def test_decode_actor_killed_mid_decode_migrates_every_stream(cluster, reference):
    """kill -9 of the only decode actor while 8 greedy and 4 seeded streams are mid-reply: each waits for the
    restarted actor, resumes there (through the prefill actor: --disagg always) and ends with exactly the text
    of an uninterrupted run, every token delivered once."""
    router = cluster._client
    prompts = make_prompts(12, seed=45)
    params = [SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)] * 8 + \
        [SamplingParams(max_tokens=160, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(4)]
    expected = await asyncio.to_thread(references, reference, prompts, params)  # off the loop: heartbeats go on
    progress = [0] * len(prompts)
    tasks = [asyncio.create_task(stream_tokens(cluster, p, sp, progress, i))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    await wait_for(lambda: min(progress) >= 3, 30, "every stream to start")
    decode = router.supervisor.ready("decode")[0]
    os.kill(decode.pid, signal.SIGKILL)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), guarded(120))
    assert outs == expected
    moved = router.counters()
    assert moved["migrations"] >= 1 and moved["migrated_tokens"] >= 3 * moved["migrations"]
    assert moved["failed_migrations"] == 0
    assert decode.restarts == 1
    await assert_clean(cluster)
    # a request that arrives while no decode actor is up waits for the restart, then completes
    prompt = make_prompts(1, seed=46)[0]
    os.kill(decode.pid, signal.SIGKILL)
    late = asyncio.create_task(generate(cluster, prompt))
    await wait_for(lambda: decode.state == "ready" and decode.restarts == 2, 60, "the decode actor's restart")
    assert await asyncio.wait_for(late, guarded(30)) == reference.generate([prompt], GREEDY)[0].token_ids
    await assert_clean(cluster)
    assert cluster.can_serve()


def references(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


async def stream_tokens(llm: AsyncLLM, prompt, params, progress: list[int], index: int) -> list[int]:
    """The stream's deltas joined; they must add up to the final output (no token twice, none missing)."""
    tokens: list[int] = []
    final = None
    async for out in llm.generate(prompt, params):
        tokens += out.outputs[0].delta_token_ids
        progress[index] = len(tokens)
        final = out
    assert final is not None and final.token_ids == tokens and final.finished
    return tokens


async def start_remote_decode_worker(llm: AsyncLLM, model_dir, secret: str, actor_id: str = "remote-decode-0",
                                     extra: tuple[str, ...] = ()):
    import sys

    host, port = llm._client.listen_address
    return await asyncio.create_subprocess_exec(
        sys.executable, "cli.py", "worker", "--role", "decode", "--connect", f"{host}:{port}",
        "--actor-id", actor_id, "--model", str(model_dir), "--dtype", "float32", "--num-kv-blocks",
        "256", "--block-size", "8", "--max-num-batched-tokens", "64", "--threads", "1", *extra,
        env={**os.environ, "PHASE_SERVE_SECRET": secret})


@pytest.mark.parametrize("kv_listen", ["", "off"], ids=["direct", "relayed"])
async def test_pages_stream_over_tcp_to_a_decode_actor_on_another_host(tiny_model_dir, reference, monkeypatch,
                                                                       kv_listen):
    """A local prefill actor hands off to a decode worker that joined over TCP (it cannot map our memory): the
    pages travel straight to the worker's KV endpoint (out-of-band frames on one kept-open connection), or,
    with `--kv-listen off`, as KVPages through the router; only the blocks the worker lacks, and outputs are
    exact either way."""
    import secrets

    secret = secrets.token_hex(16)
    monkeypatch.setenv("PHASE_SERVE_SECRET", secret)
    llm = AsyncLLM(str(tiny_model_dir), prefill_actors=1, disagg="always", listen_workers="127.0.0.1:0", **OPTIONS)
    await llm.start()
    extra = ("--kv-listen", kv_listen) if kv_listen else ()
    worker = await start_remote_decode_worker(llm, tiny_model_dir, secret, extra=extra)
    router = llm._client
    try:
        await wait_for(lambda: router.supervisor.ready("decode"), 60, "the remote decode worker")
        decode = router.supervisor.ready("decode")[0]
        assert decode.spec.remote and decode.ready.kv_export["kind"] == ("none" if kv_listen else "tcp")
        bytes_per_block = decode.ready.kv_export["bytes_per_token"] * decode.ready.block_size
        prompts = make_prompts(3, seed=48)
        outs = await asyncio.gather(*(asyncio.wait_for(generate(llm, p), guarded(60)) for p in prompts))
        assert outs == [o.token_ids for o in reference.generate(prompts, GREEDY)]
        assert router.handoff.counters.kv_transfers == 3
        assert router.handoff.counters.kv_bytes_streamed == sum(-(-len(p) // 8) for p in prompts) * bytes_per_block

        shared = make_prompts(1, seed=49)[0] * 2
        first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
        assert await generate(llm, first) == reference.generate([first], GREEDY)[0].token_ids
        before = router.handoff.counters.kv_bytes_streamed
        assert await generate(llm, second) == reference.generate([second], GREEDY)[0].token_ids
        streamed = router.handoff.counters.kv_bytes_streamed - before
        assert streamed == (-(-len(second) // 8) - len(shared) // 8) * bytes_per_block
        await assert_clean(llm)
    finally:
        await llm.aclose()
        await asyncio.wait_for(worker.wait(), guarded(20))


async def test_worker_joins_over_tcp_and_serves(tiny_model_dir, reference, monkeypatch):
    import secrets
    import sys

    secret = secrets.token_hex(16)
    monkeypatch.setenv("PHASE_SERVE_SECRET", secret)
    llm = AsyncLLM(str(tiny_model_dir), listen_workers="127.0.0.1:0", **OPTIONS)
    await llm.start()
    host, port = llm._client.listen_address
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "cli.py", "worker", "--role", "decode", "--connect", f"{host}:{port}",
        "--actor-id", "remote-decode-0", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks",
        "256", "--block-size", "8", "--max-num-batched-tokens", "64", "--threads", "1",
        env={**os.environ, "PHASE_SERVE_SECRET": secret})
    try:
        prompt = make_prompts(1, seed=47)[0]
        assert await asyncio.wait_for(generate(llm, prompt), guarded(60)) == reference.generate([prompt], GREEDY)[0].token_ids
        (handle,) = llm._client.supervisor.ready("decode")
        assert handle.actor_id == "remote-decode-0" and handle.spec.remote
    finally:
        await llm.aclose()
        await asyncio.wait_for(worker.wait(), guarded(20))
    assert worker.returncode == 0
