"""Actors on a real Ray cluster on this machine's loopback (ray.cluster_utils.Cluster): a head and three
nodes, one labelled for prefill and two for decode. Placement by resource, hand-offs over the direct KV stream
between nodes, a prefix hit streaming only the missing pages, a node removed under streaming clients, and the
server refusing layouts and addresses it cannot use."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import pytest_asyncio

from actors.ray_options import LOOPBACK_ENV, RayOptions
from engine import LLM, AsyncLLM, SamplingParams
from tests.server_utils import REPO, TINY_ENGINE_FLAGS, free_port, openai_client, start_server
from tests.test_actors import OPTIONS, assert_clean, references, stream_tokens, wait_for
from tests.test_engine import GREEDY, make_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the cluster extra (Ray)")
LOOPBACK = {LOOPBACK_ENV: "0"}  # every node and the GCS on 127.0.0.1; Ray reads it once, at its import
NODE_MEMORY = dict(object_store_memory=80 << 20)  # the object store is unused: the smallest Ray allows
ROLES = RayOptions("auto", prefill_resources=(("prefill_node", 1.0),), decode_resources=(("decode_node", 1.0),))
on_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOOPBACK.items():
            patch.setenv(key, value)
        assert "ray" not in sys.modules, "Ray was imported before its loopback setting"
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args=dict(num_cpus=0, include_dashboard=False, **NODE_MEMORY))
        for label in ("prefill_node", "decode_node", "decode_node"):
            cluster.add_node(num_cpus=1, resources={label: 1}, **NODE_MEMORY)
        yield cluster
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def placed(tiny_model_dir, ray_cluster):
    """One prefill actor on the prefill node, one decode actor on a decode node, every request handed off."""
    options = RayOptions(ray_cluster.address, prefill_resources=ROLES.prefill_resources,
                         decode_resources=ROLES.decode_resources)
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always", ray=options, **OPTIONS)
    await llm.start()
    yield llm
    await llm.aclose()


def nodes_with(resource: str) -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)}


def ray_actor_nodes() -> set[str]:
    """Where Ray says our live actors run (its GCS actor table)."""
    from ray._private import state  # the GCS actor table (ray.util.state needs the dashboard)

    return {a["Address"]["NodeID"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].endswith("ActorProcess")}


def handle(llm: AsyncLLM, role: str):
    return next(h for h in llm._client.supervisor.handles if h.spec.role == role)


@on_module_loop
async def test_every_node_is_on_loopback(placed):
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}


@on_module_loop
async def test_roles_land_on_their_nodes_and_match_the_colocated_outputs(placed, reference):
    prefill, decode = handle(placed, "prefill"), handle(placed, "decode")
    assert prefill.hello.node_id in nodes_with("prefill_node")
    assert decode.hello.node_id in nodes_with("decode_node")
    assert ray_actor_nodes() == {prefill.hello.node_id, decode.hello.node_id}
    assert "endpoint" in decode.ready.kv_export  # another node's prefill streams to it
    prompts = make_prompts(6, seed=71)
    before = placed._client.handoff.counters.kv_bytes_streamed
    outs = await asyncio.gather(*(_generate(placed, p) for p in prompts))
    assert outs == [o.token_ids for o in reference.generate(prompts, GREEDY)]
    assert placed._client.handoff.counters.kv_bytes_streamed > before  # over TCP, node to node
    await assert_clean(placed)


@on_module_loop
async def test_a_prefix_hit_streams_only_the_missing_pages(placed):
    decode = handle(placed, "decode")
    block_size, per_token = decode.ready.block_size, decode.ready.kv_export["bytes_per_token"]
    page = block_size * per_token  # one block, every layer
    prompt = make_prompts(1, seed=72, vocab=400)[0][:5] * 10  # 50 tokens
    first = await _streamed(placed, prompt[:48])
    second = await _streamed(placed, prompt[:48] + [7] * 16)
    assert first == 6 * page  # 48 tokens: six fresh blocks
    assert second == 2 * page  # the first six blocks were cached on the decode actor
    await assert_clean(placed)


@on_module_loop
async def test_status_lists_each_actor_with_its_node(placed):
    actors = {a["id"]: a for a in placed.actors()}
    assert {a["node"]["id"] for a in actors.values()} == ray_actor_nodes()
    assert {a["node"]["address"] for a in actors.values()} == {"127.0.0.1"}


@on_module_loop
async def test_a_killed_ray_actor_is_replaced_by_a_new_one(placed, reference):
    router, prefill = placed._client, handle(placed, "prefill")
    restarts, old_pid = prefill.restarts, prefill.pid
    router.supervisor.kill(prefill.actor_id)  # ray.kill: its run() fails with RayActorError
    await wait_for(lambda: prefill.state == "ready" and prefill.restarts > restarts, 60, "a new prefill actor")
    assert prefill.pid != old_pid and prefill.hello.node_id in nodes_with("prefill_node")
    assert ray_actor_nodes() == {prefill.hello.node_id, handle(placed, "decode").hello.node_id}
    prompts = make_prompts(3, seed=74)
    before = router.handoff.counters.kv_transfers
    assert await asyncio.gather(*(_generate(placed, p) for p in prompts)) == \
        [o.token_ids for o in reference.generate(prompts, GREEDY)]
    assert router.handoff.counters.kv_transfers == before + 3  # handed off by the new actor
    await assert_clean(placed)


@on_module_loop
async def test_removing_the_decode_node_moves_its_streams_to_a_new_actor(placed, reference, ray_cluster):
    router, decode = placed._client, handle(placed, "decode")
    lost = decode.hello.node_id
    prompts = make_prompts(8, seed=73)
    params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)] * 8
    expected = await asyncio.to_thread(references, reference, prompts, params)
    progress = [0] * 8
    tasks = [asyncio.create_task(stream_tokens(placed, p, sp, progress, i))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    await wait_for(lambda: min(progress) >= 3, 60, "every stream to start")
    node = next(n for n in ray_cluster.worker_nodes if n.node_id == lost)
    await asyncio.to_thread(ray_cluster.remove_node, node)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 150)
    assert outs == expected
    assert router.counters()["migrations"] >= 1 and router.counters()["failed_migrations"] == 0
    await wait_for(lambda: decode.state == "ready", 60, "the decode actor on another node")
    assert decode.hello.node_id != lost and decode.hello.node_id in nodes_with("decode_node")
    await assert_clean(placed)
    assert {a["node"]["id"] for a in placed.actors()} == ray_actor_nodes()


def test_an_address_that_does_not_answer_is_an_error(tiny_model_dir, tmp_path):
    done = _serve(tiny_model_dir, "--ray", f"127.0.0.1:{free_port()}")
    assert done.returncode != 0
    assert "cannot reach the Ray cluster at 127.0.0.1:" in done.stderr


def test_an_address_that_accepts_but_never_answers_is_an_error(tiny_model_dir):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel completes the handshakes; no reply
        done = _serve(tiny_model_dir, "--ray", f"127.0.0.1:{silent.getsockname()[1]}", "--ray-connect-timeout", "3")
    assert done.returncode != 0
    assert "cannot reach the Ray cluster at 127.0.0.1:" in done.stderr and "no answer within 3s" in done.stderr


def test_a_resource_no_node_has_refuses_to_start_naming_it(tiny_model_dir, ray_cluster):
    done = _serve(tiny_model_dir, "--ray", ray_cluster.address, "--ray-decode-resources", '{"hbm_node": 1}')
    assert done.returncode != 0
    assert "no node with the resource 'hbm_node'" in done.stderr


def _serve(model_dir, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "cli.py", "serve", "--model", str(model_dir), *TINY_ENGINE_FLAGS, "--port",
           str(free_port()), "--log-format", "json", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=90,
                          env={**os.environ, **LOOPBACK}, stdin=subprocess.DEVNULL)


async def _generate(llm: AsyncLLM, prompt) -> list[int]:
    token_ids: list[int] = []
    async for out in llm.generate(prompt, GREEDY):
        token_ids = out.token_ids
    return token_ids


async def _streamed(llm: AsyncLLM, prompt) -> int:
    """The page bytes one hand-off of `prompt` streamed between nodes."""
    before = llm._client.handoff.counters.kv_bytes_streamed
    await _generate(llm, prompt)
    return llm._client.handoff.counters.kv_bytes_streamed - before


@pytest.fixture(scope="module")
def local_server(tiny_model_dir, tmp_path_factory):
    """`serve --ray local`: a private Ray cluster started by the server, on loopback."""
    proc = start_server(tmp_path_factory.mktemp("ray") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", "tiny", "--ray", "local", "--decode-actors", "1")
    yield proc
    assert proc.stop() == 0


def test_the_openai_client_chats_and_streams_with_ray_local(local_server):
    client = openai_client(local_server)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    decode = next(a for a in local_server.get("/status").json()["actors"] if a["role"] == "decode")
    assert decode["state"] == "ready" and decode["node"]["address"] == "127.0.0.1"
    assert decode["node"]["id"] and not decode["node"]["id"].startswith("host:")  # a Ray node id
