"""`python -m bench.kv_transfer --ray`: KV hand-offs between Ray nodes against within one (see bench.kv_transfer's
description). Needs the cluster extra; everything stays on 127.0.0.1."""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

from actors.ray_options import LOOPBACK_ENV, RayOptions

BLOCK = 16
NODE_MEMORY = dict(object_store_memory=80 << 20)  # the object store is unused: the smallest Ray allows
LAYOUTS = (("prefill on A, decode on B (TCP stream)", "node_b"), ("both on A (shared memory)", "node_a"))
OVERLAPS = ("none", "chunk")


def start_cluster():
    """A head without CPUs, node A and node B; their CPUs are Ray's bookkeeping, not cores: A has room for
    two servers' worth of actors (bench.placement runs ray-apart and ray-together side by side), B for two."""
    if "ray" in sys.modules:
        raise RuntimeError("Ray was imported before its loopback setting")
    os.environ[LOOPBACK_ENV] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args=dict(num_cpus=0, include_dashboard=False, **NODE_MEMORY))
    cluster.add_node(num_cpus=4, resources={"node_a": 4}, **NODE_MEMORY)
    cluster.add_node(num_cpus=2, resources={"node_b": 2}, **NODE_MEMORY)
    return cluster


async def ttfts(model_dir: str, address: str, prompts: list[list[int]], decode_node: str,
                overlap: str) -> tuple[list[float], int, bool]:
    """TTFTs (ms) of `prompts` one at a time, the KV bytes of one hand-off, and whether the two actors ran on
    different nodes."""
    from engine import AsyncLLM, SamplingParams

    options = RayOptions(address, prefill_resources=(("node_a", 1.0),), decode_resources=((decode_node, 1.0),))
    llm = AsyncLLM(model_dir, prefill_actors=1, decode_actors=1, disagg="always", ray=options, dtype="float32",
                   kv_stream_overlap=overlap, block_size=BLOCK, max_num_batched_tokens=512, num_kv_blocks=2 * -(-len(prompts[0]) // BLOCK) + 8)
    await llm.start()
    router, samples = llm._client, []
    try:
        nodes = {h.spec.role: h.hello.node_id for h in router.supervisor.handles}
        before = router.handoff.counters.kv_bytes_transferred
        for prompt in prompts:
            start = time.perf_counter()
            async for _ in llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
                break
            samples.append((time.perf_counter() - start) * 1e3)
        per_handoff = (router.handoff.counters.kv_bytes_transferred - before) // len(prompts)
    finally:
        await llm.aclose()
    return samples, per_handoff, nodes["prefill"] != nodes["decode"]


async def run_ray(model_dir: str, sizes: list[int], repeats: int) -> None:
    cluster = start_cluster()
    rng = random.Random(7)
    try:
        for tokens in sizes:
            await _one_size(model_dir, cluster.address, tokens, repeats, rng)
    finally:
        cluster.shutdown()


async def _one_size(model_dir: str, address: str, tokens: int, repeats: int, rng: random.Random) -> None:
    print(f"{tokens}-token prompts, fp32 KV, median TTFT of {repeats} fresh prompts (after one warm-up):", flush=True)
    medians, handoff = {}, 0
    for label, decode_node in LAYOUTS:
        for overlap in OVERLAPS:
            prompts = [[rng.randrange(1, 500) for _ in range(tokens)] for _ in range(repeats + 1)]
            samples, handoff, apart = await ttfts(model_dir, address, prompts, decode_node, overlap)
            medians[decode_node, overlap] = statistics.median(samples[1:])
            where = "different nodes" if apart else "one node"
            print(f"  {label:<40} overlap {overlap:<5} {medians[decode_node, overlap]:8.1f} ms  ({where}; "
                  f"{', '.join(f'{x:.0f}' for x in samples[1:])})", flush=True)
    extra = medians["node_b", "none"] - medians["node_a", "none"]
    rate = f"{handoff / extra / 1e6:.2f} GB/s" if extra > 0 else "not measurable (no extra time)"
    print(f"  cross-node hand-off of {handoff / 1e6:.1f} MB: +{extra:.1f} ms over shared memory "
          f"without overlap: {rate}; with overlap (chunk) +{medians['node_b', 'chunk'] - medians['node_a', 'chunk']:.1f}"
          " ms", flush=True)
