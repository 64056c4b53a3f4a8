"""Degrade instead of fail on a real Ray cluster on this machine's loopback: a head with no CPUs, one prefill node and
one decode node of one CPU each, so that no node has room for another decode actor. Removing the decode actor's
node leaves the decode role to the prefill actor, colocated: the streams that were running end as an uninterrupted
run ends them, and new requests are served again, by the former prefill actor."""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import time

import pytest
import pytest_asyncio

from actors.ray_options import LOOPBACK_ENV, RayOptions
from engine import LLM, AsyncLLM, SamplingParams
from tests.test_actors import OPTIONS, assert_clean, references, stream_tokens, wait_for
from tests.test_engine import make_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the cluster extra (Ray)")
NODE_MEMORY = dict(object_store_memory=80 << 20)
ROLES = dict(prefill_resources=(("prefill_node", 1.0),), decode_resources=(("decode_node", 1.0),))
on_module_loop = pytest.mark.asyncio(loop_scope="module")
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LOOPBACK_ENV, "0")  # Ray reads it once, at its import (tests/test_ray.py sets it the same way)
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args=dict(num_cpus=0, include_dashboard=False, **NODE_MEMORY))
        for label in ("prefill_node", "decode_node"):
            cluster.add_node(num_cpus=1, resources={label: 1}, **NODE_MEMORY)
        yield cluster
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def placed(tiny_model_dir, ray_cluster):
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always",
                   ray=RayOptions(ray_cluster.address, **ROLES), **OPTIONS)  # degrading after the default 5 s
    await llm.start()
    yield llm
    await llm.aclose()


def handle(llm: AsyncLLM, actor_id: str):
    return llm._client.supervisor.by_id(actor_id)


@on_module_loop
async def test_removing_the_only_decode_node_leaves_the_decode_role_to_the_prefill_actor(placed, reference,
                                                                                         ray_cluster):
    router, decode, prefill = placed._client, handle(placed, "decode-0"), handle(placed, "prefill-0")
    prompts = make_prompts(6, seed=81)
    params = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected = await asyncio.to_thread(references, reference, prompts, params)
    progress = [0] * len(prompts)
    tasks = [asyncio.create_task(stream_tokens(placed, p, sp, progress, i))
             for i, (p, sp) in enumerate(zip(prompts, params))]
    await wait_for(lambda: min(progress) >= 3, 60, "every stream to start")
    node = next(n for n in ray_cluster.worker_nodes if n.node_id == decode.hello.node_id)
    removed = time.monotonic()
    await asyncio.to_thread(ray_cluster.remove_node, node)
    assert await asyncio.wait_for(asyncio.gather(*tasks), 150) == expected
    assert prefill.spec.role == "decode" and decode.state != "ready"  # no node has room for a decode actor
    prompt = make_prompts(1, seed=82)[0]
    short = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = [out async for out in placed.generate(prompt, short)]
    served = time.monotonic() - removed
    log.info("a request succeeded %.1f s after the decode node was removed", served)  # measured, not asserted
    assert outputs[-1].placement.startswith("colocated; decode=prefill-0;")
    assert outputs[-1].token_ids == (await asyncio.to_thread(reference.generate, [prompt], short))[0].token_ids
    status = placed.layout_status()
    assert status["degrade"]["stand_ins"] == ["prefill-0"] and status["current"] == "0P+1D"
    assert status["roles"]["recent"][-1]["reason"].startswith("degrade: no decode actor serves: decode-0 down")
    assert router.counters()["failed_migrations"] == 0
    await assert_clean(placed)
