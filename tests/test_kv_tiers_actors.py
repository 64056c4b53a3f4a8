"""The KV tiers across processes: a decode actor and another process share the host tier that the server's main
process owns; an actor killed while writing back leaves a tier whose every entry is whole; `serve` restarted on
the same disk tier computes only past the cached prefix and says so in usage, /status and /metrics; and on the
default model, a prefix loaded from the tiers gives the output computed without them."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import pytest_asyncio

from engine import LLM, AsyncLLM, SamplingParams
from engine.kv.prefix_index import prefix_block_hashes
from engine.kv.tier_store import HEADER, TEMP_PREFIX, TierStore, stored_depth
from tests.server_utils import guarded, start_server, wait_for, wait_until
from tests.test_kv_tiers import BS, DOC, DOC_BLOCKS, FIRST, GREEDY, OPTIONS, SECOND, tokens

HOST_SIZE = 16 << 20


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(tiny_model_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, kv_host_size=HOST_SIZE, kv_disk_dir=str(disk), **OPTIONS)
    await llm.start()
    yield llm
    host = llm._client.supervisor.host_tier.path
    assert host.is_dir()
    await llm.aclose()
    assert not host.exists(), "the host tier outlived the process that owns it"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), **dict(OPTIONS, num_kv_blocks=256, enable_prefix_caching=False))
    return lambda prompt: llm.generate([prompt], GREEDY)[0].token_ids


async def generate(llm: AsyncLLM, prompt, params=GREEDY):
    last = None
    async for out in llm.generate(prompt, params):
        last = out
    return last


async def evict_actor_pool(llm: AsyncLLM, seed: int = 99) -> None:
    await generate(llm, tokens(seed, OPTIONS["num_kv_blocks"] * BS - 1), SamplingParams(max_tokens=1))


def host_tier(llm: AsyncLLM) -> tuple:
    """(the decode actor's handle, the host tier's directory, the actors' tier namespace)."""
    handle = llm._client.supervisor.ready("decode")[0]
    tiers = handle.ready.kv_export["kv_tiers"]
    return handle, llm._client.supervisor.host_tier.path, bytes.fromhex(tiers["namespace"])


async def assert_clean(llm: AsyncLLM) -> None:
    router = llm._client
    await wait_for(lambda: not router.routed, 10, "the router to forget finished requests")
    for handle in router.supervisor.ready("decode"):
        report = await router.integrity.check(handle.actor_id)
        assert report.error is None, report.error
        assert (report.used_blocks, report.reservations, report.running) == (0, 0, 0), report


@pytest.mark.asyncio(loop_scope="module")
async def test_an_actor_and_another_process_share_the_host_tier(served, reference, tiny_model_dir):
    handle, host, namespace = host_tier(served)
    assert str(host) in handle.ready.kv_export["kv_tiers"]["dirs"]
    first = await generate(served, FIRST)
    assert first.outputs[0].token_ids == reference(FIRST)
    await evict_actor_pool(served)
    doc_hashes = prefix_block_hashes(DOC, BS)
    assert wait_until(lambda: stored_depth([host], namespace, doc_hashes) == DOC_BLOCKS, 20)
    # the other process's engine runs off the loop, which keeps the actor's heartbeats going
    neighbour = await asyncio.to_thread(LLM, str(tiny_model_dir), **OPTIONS, kv_host_size=HOST_SIZE,
                                        kv_host_dir=str(host))
    assert neighbour.engine.scheduler.tiers.namespace == namespace  # the same model and format: one namespace
    run = lambda prompt, params=GREEDY: asyncio.to_thread(neighbour.generate, [prompt], params)
    second = (await run(SECOND))[0]  # computed by the actor, loaded here
    assert second.num_cached_tokens == DOC_BLOCKS * BS and second.token_ids == reference(SECOND)
    other = tokens(5, 15 * BS) + tokens(6, 9)
    await run(other)
    await run(tokens(98, OPTIONS["num_kv_blocks"] * BS - 1), SamplingParams(max_tokens=1))
    assert neighbour.engine.scheduler.tiers.flush(timeout=60)
    back = await generate(served, other[:-4] + [7, 7, 7])  # computed here, loaded by the actor
    assert back.num_cached_tokens == 15 * BS and back.outputs[0].token_ids == reference(other[:-4] + [7, 7, 7])
    neighbour.engine.close()
    assert host.is_dir()  # the neighbour only attached
    await assert_clean(served)


@pytest.mark.asyncio(loop_scope="module")
async def test_an_actor_killed_while_writing_back_leaves_a_sound_tier(served, reference):
    handle, host, namespace = host_tier(served)
    restarts, pid = handle.restarts, handle.pid
    for seed in range(3):  # a burst of evictions, then the kill while their write-back may still run
        await generate(served, tokens(200 + seed, 12 * BS) + tokens(300 + seed, 12 * BS))
        await evict_actor_pool(served, seed=400 + seed)
    os.kill(pid, signal.SIGKILL)
    await wait_for(lambda: handle.state == "ready" and handle.restarts == restarts + 1, 60, "the restart")
    assert not [n for n in os.listdir(host) if n.startswith(f"{TEMP_PREFIX}{pid}-")]  # reclaimed by the new actor
    store = TierStore("host", host, HOST_SIZE, namespace, lambda: 0)
    entries = store.scan()
    assert entries and sum(e.size for e in entries) == store.usage()
    payload = bytearray(int(handle.ready.kv_export["bytes_per_token"] * BS))
    assert all(store.read(*_hash_and_depth(entry.path), payload) for entry in entries)  # every entry whole
    assert store.bad_entries == 0
    out = await generate(served, SECOND)
    assert out.outputs[0].token_ids == reference(SECOND) and out.num_cached_tokens > 0
    await assert_clean(served)
    store.close()


def _hash_and_depth(path) -> tuple[int, int]:
    """The block hash and depth an entry's header names."""
    with open(path, "rb") as handle:
        fields = HEADER.unpack(handle.read(HEADER.size))
    return fields[4], fields[5]


def test_serve_restarted_on_its_disk_tier_computes_only_past_the_prefix(tiny_model_dir, tmp_path):
    plain = LLM(str(tiny_model_dir), **dict(OPTIONS, num_kv_blocks=256, enable_prefix_caching=False))
    expected_text = plain.generate([SECOND], GREEDY)[0].outputs[0].text
    flags = ("--dtype", "float32", "--num-kv-blocks", "40", "--block-size", str(BS), "--threads", "1",
             "--kv-disk-dir", str(tmp_path / "disk"), "--kv-host-size", "16MiB")
    body = lambda prompt: {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    server = start_server(tmp_path / "first.log", "--model", str(tiny_model_dir), *flags)
    try:
        first = server.post("/v1/completions", body(FIRST)).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        name = first["model"]
    finally:
        assert server.stop() == 0
    server = start_server(tmp_path / "second.log", "--model", str(tiny_model_dir), *flags)
    try:
        second = server.post("/v1/completions", body(SECOND)).json()
        assert second["choices"][0]["text"] == expected_text
        usage = second["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == DOC_BLOCKS * BS
        assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] == len(SECOND) - len(DOC)
        tiers = lambda: server.get("/status").json()["kv_tiers"]  # as of the actor's last heartbeat
        assert wait_until(lambda: tiers()["disk"]["hits"] == DOC_BLOCKS, 10)
        status = tiers()
        assert status["bad_entries"] == 0 and status["host"]["hits"] == 0  # the host tier began empty
        assert status["host"]["bytes_total"] == 16 << 20
        metrics = server.get("/metrics").body.decode()
        assert f'phase_serve:external_prefix_cache_hits_total{{model_name="{name}",tier="disk"}} 25.0' in metrics
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_the_default_model_gives_the_computed_output_from_either_tier(tmp_path):
    """SmolLM2 in fp32: the text after a prefix loaded from the host tier, and from the disk tier in a new engine,
    is the text computed at first, with nothing cached."""
    tiers = dict(kv_host_size=64 << 20, kv_disk_dir=str(tmp_path / "disk"))
    options = dict(dtype="float32", block_size=16, num_kv_blocks=24, kv_tier_load_timeout=guarded(60))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(**options, **tiers)
    ids = llm.tokenizer.encode("The history of the Roman Empire, told year by year: " * 30)[:300]
    prompt = ids + llm.tokenizer.encode(" In summary,")
    computed = llm.generate([prompt], params)[0]
    assert computed.num_cached_tokens == 0
    llm.generate([ids[::-1] + ids[:83]], SamplingParams(max_tokens=1))  # the whole pool: 24 blocks
    assert llm.engine.scheduler.tiers.flush(timeout=60)
    loaded = llm.generate([prompt], params)[0]
    blocks = (len(prompt) - 1) // 16
    assert loaded.num_cached_tokens == blocks * 16 and llm.engine.stats().kv_host_hits == blocks
    assert loaded.token_ids == computed.token_ids
    llm.engine.close()  # what its pool holds goes to the disk tier
    again = LLM(**options, kv_disk_dir=tiers["kv_disk_dir"])
    restarted = again.generate([prompt], params)[0]
    assert restarted.num_cached_tokens == blocks * 16 and again.engine.stats().kv_disk_hits == blocks
    assert restarted.token_ids == computed.token_ids
    again.engine.close()
