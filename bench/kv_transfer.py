"""KV hand-off cost: shared memory (what actors on one host use) and TCP loopback (actors on other hosts),
against a plain memory copy of the same bytes in the same run; then the TTFT of a disaggregated prompt with
and without the layer-wise overlap.

    python -m bench.kv_transfer [--tokens 1024,8192,32768] [--repeats 5] [--ttft-tokens 4096] [--ttft-repeats 3]
    python -m bench.kv_transfer --ray [--tokens 1024,8192] [--repeats 3]

Geometry is SmolLM2-135M's (30 layers, 3 KV heads x 64, bf16: 23,040 bytes per token). Per size it reports:
- memcpy: one torch copy of the prompt's KV bytes (the bound for anything that moves them);
- shm write+verify: another process writes the pages into the exported pool and reports ready with the
  hand-off fingerprint; the owner verifies it;
- shm protocol only: the same without the page write. This is what the zero-copy path adds to a prefill,
  since a prefill actor writes each layer's KV in place as it computes it;
- tcp relayed (the path without a KV endpoint, `worker --kv-listen off`): each layer's pages as a KVPages
  msgpack frame over authenticated loopback TCP to a relay that decodes and re-sends it (the router), then
  written into the receiver's pool (KVCache.read_pages / write_pages);
- tcp direct (the default): each layer's pages out of band on one kept-open connection straight to the
  receiver's KV endpoint (transport.kv_stream: sendmsg of the pool's memory, received into a held buffer,
  written under the reservation lock), timed to the receiver's acknowledgement.
Everything runs in this process (the direct path's ends on their own threads).

Ray (`--ray`, needs the cluster extra): a Ray cluster on this host's loopback (ray.cluster_utils: a head and
nodes A and B) and the same random model as the TTFT run, one prefill and one decode Ray actor, one thread
each, every request disaggregated: the prefill actor on A and the decode actor on B (the pages go over the
direct KV stream) against both on A (the pages are written in place in shared memory). With the pages sent
after the prefill (--kv-stream-overlap none) the TTFT difference is the cross-node transfer, so the bytes
handed off over it give the hand-off GB/s; the default overlap (chunk) shows what is left of it in the TTFT.

TTFT (`--ttft-tokens`, 0 to skip): a random model with SmolLM2-135M's KV geometry (30 layers, 3 KV heads x 64;
hidden 192, so the prefill is short), fp32, one prefill actor and one decode worker joined over TCP, one
thread each: the first token of a fresh prompt, disaggregated with the pages sent after the prefill
(--kv-stream-overlap none), after each layer of the last chunk (layer), after each layer of each chunk
(chunk, the default); and colocated on the decode worker.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv.export import create_shared_pool, open_shared_pool
from engine.config import ModelConfig
from engine.kv.cache import KVCache
from transport import connect_tcp, serve_tcp
from transport import messages as m
from transport.kv_stream import KVStreamSender, KVStreamServer

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
DTYPE = torch.bfloat16


@dataclass
class Row:
    tokens: int
    mbytes: float
    memcpy_ms: float
    shm_write_verify_ms: float
    shm_protocol_ms: float
    tcp_ms: float
    direct_ms: float

    def line(self) -> str:
        gbps = lambda ms: self.mbytes / 1e3 / (ms / 1e3)  # noqa: E731
        return (f"{self.tokens:>7} {self.mbytes:>9.1f} {self.memcpy_ms:>9.2f} ({gbps(self.memcpy_ms):5.2f} GB/s) "
                f"{self.shm_write_verify_ms:>9.2f} ({gbps(self.shm_write_verify_ms):5.2f} GB/s) "
                f"{self.shm_protocol_ms:>9.2f} {self.tcp_ms:>9.2f} ({gbps(self.tcp_ms):5.2f} GB/s) "
                f"{self.direct_ms:>9.2f} ({gbps(self.direct_ms):5.2f} GB/s)")


def pool_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, num_blocks, BLOCK, HEADS, HEAD_DIM)


def median_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


GEOMETRY = ModelConfig(vocab_size=1, hidden_size=HEADS * HEAD_DIM, intermediate_size=1, num_layers=LAYERS,
                       num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM)


def checksum(pool: torch.Tensor, blocks: torch.Tensor) -> int:
    """The same fingerprint the decode actor verifies before decoding from handed-off blocks."""
    kv = KVCache(GEOMETRY, pool.shape[2], BLOCK, pool.dtype, storage=pool)
    return kv.checksum(blocks.tolist())[1]


def run_shm(tokens: int, repeats: int, write: bool) -> float:
    """Owner exports a pool; a separate process maps it once, then per hand-off writes pages + reports."""
    import multiprocessing as mp

    nblocks = -(-tokens // BLOCK)
    import tempfile

    pool = create_shared_pool(pool_shape(nblocks), DTYPE, tag="bench")
    socket_dir = tempfile.mkdtemp()
    pool.serve(f"{socket_dir}/kv.sock")  # how the writer process gets the pool's descriptor
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_shm_writer, args=(pool.export, nblocks, requests, replies), daemon=True)
    proc.start()
    replies.get()  # mapped and ready
    blocks = torch.arange(nblocks)
    try:
        def one() -> None:
            requests.put(write)
            crc = replies.get()
            assert crc == checksum(pool.tensor, blocks), "hand-off failed its checksum"

        return median_ms(one, repeats)
    finally:
        requests.put(None)
        proc.join(10)
        pool.close()


def _shm_writer(export: dict, nblocks: int, requests, replies) -> None:
    torch.set_num_threads(1)
    pool = open_shared_pool(export)
    pages = torch.randn(pool_shape(nblocks), dtype=torch.float32).to(DTYPE)
    blocks = torch.arange(nblocks)
    replies.put("ready")
    while (write := requests.get()) is not None:
        if write:
            pool.index_copy_(2, blocks, pages)
        replies.put(checksum(pool, blocks))


async def run_tcp(tokens: int, repeats: int) -> float:
    nblocks = -(-tokens // BLOCK)
    secret = secrets.token_bytes(32)
    dest = torch.zeros(pool_shape(nblocks), dtype=DTYPE)
    dest_cache = KVCache(GEOMETRY, nblocks, BLOCK, DTYPE, storage=dest)
    done: asyncio.Queue = asyncio.Queue()

    async def receiver(conn) -> None:
        async for msg in conn:
            dest_cache.write_pages(msg.layer, msg.block_ids, msg.payload)  # what a remote decode actor does
            if msg.layer == LAYERS - 1:
                await done.put(True)

    server = await serve_tcp("127.0.0.1", 0, secret, receiver)
    relay_to = await connect_tcp(*server.address, secret)

    async def relay(conn) -> None:  # the router: decodes each KVPages frame and sends it on
        async for msg in conn:
            await relay_to.send(msg)

    relay_server = await serve_tcp("127.0.0.1", 0, secret, relay)
    conn = await connect_tcp(*relay_server.address, secret)
    pages = torch.randn(pool_shape(nblocks), dtype=torch.float32).to(DTYPE)
    block_ids = list(range(nblocks))
    source = KVCache(GEOMETRY, nblocks, BLOCK, DTYPE, storage=pages)
    payloads = [source.read_pages(layer, block_ids) for layer in range(LAYERS)]  # what a prefill actor sends
    samples = []
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            for layer in range(LAYERS):
                await conn.send(m.KVPages("bench", layer, block_ids, payloads[layer]))
            await done.get()
            if i:
                samples.append((time.perf_counter() - start) * 1e3)
        assert torch.equal(dest, pages), "TCP hand-off corrupted the pages"
    finally:
        await conn.aclose()
        await relay_to.aclose()
        await relay_server.close()
        await server.close()
    return statistics.median(samples)


class _PoolSink:
    """The receiving end of a direct stream, as a decode actor on another host runs it."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.written = cache, 0
        import threading
        self.lock = threading.Lock()

    def page_bytes(self, layer: int, block_ids: list[int]) -> int:
        return len(block_ids) * self.cache.bytes_per_layer_block

    def write(self, request_id: str, layer: int, block_ids: list[int], payload: memoryview) -> None:
        with self.lock:
            self.cache.write_pages(layer, block_ids, payload)
            self.written += len(payload)

    def finish(self, request_id: str) -> tuple[int, str | None]:
        written, self.written = self.written, 0
        return written, None


def run_direct(tokens: int, repeats: int) -> float:
    import threading

    nblocks = -(-tokens // BLOCK)
    secret = secrets.token_bytes(32)
    dest = torch.zeros(pool_shape(nblocks), dtype=DTYPE)
    server = KVStreamServer("127.0.0.1", 0, secret, _PoolSink(KVCache(GEOMETRY, nblocks, BLOCK, DTYPE, storage=dest)))
    sender = KVStreamSender(*server.address, secret)
    pages = torch.randn(pool_shape(nblocks), dtype=torch.float32).to(DTYPE)
    source = KVCache(GEOMETRY, nblocks, BLOCK, DTYPE, storage=pages)
    block_ids = list(range(nblocks))
    samples = []
    try:
        for i in range(repeats + 1):
            done = threading.Event()
            start = time.perf_counter()
            for layer in range(LAYERS):  # what a prefill actor's step thread queues: views of its pool
                sender.send_pages(f"r{i}", layer, block_ids, pages[layer], source.bytes_per_layer_block)
            sender.end(f"r{i}", time.monotonic() + 60, lambda n, err, _seconds: done.set())
            done.wait(60)
            if i:
                samples.append((time.perf_counter() - start) * 1e3)
        assert torch.equal(dest, pages), "the direct stream corrupted the pages"
    finally:
        sender.close()
        server.close()
    return statistics.median(samples)


def run_memcpy(tokens: int, repeats: int) -> float:
    src = torch.randn(pool_shape(-(-tokens // BLOCK)), dtype=torch.float32).to(DTYPE)
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src), repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ttft-tokens", type=int, default=4096)
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="only the Ray two-node comparison (see above)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.ray:
        from bench.ray_nodes import run_ray

        sizes = [int(t) for t in args.tokens.split(",") if t]
        asyncio.run(run_ray(geometry_model(max(sizes)), sizes, args.repeats))
        return
    print(f"torch threads {torch.get_num_threads()}; bytes per token {LAYERS * 2 * HEADS * HEAD_DIM * 2}")
    print(f"{'tokens':>7} {'MB':>9} {'memcpy ms':>22} {'shm write+verify ms':>22} {'shm proto ms':>9} "
          f"{'tcp relayed ms':>22} {'tcp direct ms':>22}")
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        mbytes = LAYERS * 2 * -(-tokens // BLOCK) * BLOCK * HEADS * HEAD_DIM * 2 / 1e6
        row = Row(tokens, mbytes, run_memcpy(tokens, args.repeats), run_shm(tokens, args.repeats, True),
                  run_shm(tokens, args.repeats, False), asyncio.run(run_tcp(tokens, args.repeats)),
                  run_direct(tokens, args.repeats))
        print(row.line(), flush=True)
    if args.ttft_tokens:
        asyncio.run(run_ttft(args.ttft_tokens, args.ttft_repeats))


async def _ttft_once(model_dir: str, prompts: list[list[int]], overlap: str | None) -> list[float]:
    """TTFTs (ms) of `prompts`, one at a time, on a prefill actor and a decode worker joined over TCP
    (overlap: the prefill actor's --kv-stream-overlap), or colocated on the worker (overlap None)."""
    import os
    import sys

    from engine import AsyncLLM, SamplingParams

    secret = secrets.token_hex(16)
    env = {**os.environ, "PHASE_SERVE_SECRET": secret}
    os.environ.update(PHASE_SERVE_SECRET=secret)
    options = dict(dtype="float32", block_size=BLOCK, max_num_batched_tokens=512, num_kv_blocks=8,
                   kv_stream_overlap=overlap or "chunk")
    llm = AsyncLLM(model_dir, prefill_actors=1, disagg="never" if overlap is None else "always",
                   listen_workers="127.0.0.1:0", **options)
    await llm.start()
    host, port = llm._client.listen_address
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "cli.py", "worker", "--role", "decode", "--connect", f"{host}:{port}", "--actor-id",
        "remote-decode-0", "--model", model_dir, "--dtype", "float32", "--num-kv-blocks",
        str(2 * -(-len(prompts[0]) // BLOCK) + 8), "--block-size", str(BLOCK), "--max-num-batched-tokens", "512",
        "--threads", "1", env=env)
    samples = []
    try:
        while not llm._client.supervisor.ready("decode"):
            await asyncio.sleep(0.1)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for prompt in prompts:
            start = time.perf_counter()
            async for _ in llm.generate(prompt, params):
                break
            samples.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.5)  # the request finishes and frees its blocks
    finally:
        await llm.aclose()
        await asyncio.wait_for(worker.wait(), 30)
    return samples


def geometry_model(tokens: int) -> str:
    """A random model folder with SmolLM2-135M's KV geometry and a small hidden size (a short prefill)."""
    import tempfile

    from tests.tiny_models import tiny_llama_config, write_tiny_model

    config = tiny_llama_config(hidden_size=HEADS * HEAD_DIM, intermediate_size=512, num_hidden_layers=LAYERS,
                               num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * tokens)
    return str(write_tiny_model(Path(tempfile.mkdtemp()), config, seed=3))


async def run_ttft(tokens: int, repeats: int) -> None:
    import random

    model_dir = geometry_model(tokens)
    rng = random.Random(5)
    kv_mb = LAYERS * 2 * HEADS * HEAD_DIM * 4 * tokens / 1e6
    print(f"TTFT of a {tokens}-token prompt ({kv_mb:.0f} MB of fp32 KV), median of {repeats} fresh prompts:")
    results = {}
    for label, overlap in (("disaggregated, pages after the prefill (none)", "none"),
                           ("disaggregated, layer-wise at the last chunk (layer)", "layer"),
                           ("disaggregated, layer-wise per chunk (chunk)", "chunk"),
                           ("colocated on the decode worker", None)):
        prompts = [[rng.randrange(1, 500) for _ in range(tokens)] for _ in range(repeats + 1)]
        samples = (await _ttft_once(model_dir, prompts, overlap))[1:]  # the first warms the actors up
        results[overlap] = statistics.median(samples)
        print(f"  {label:<52} {results[overlap]:9.1f} ms  ({', '.join(f'{x:.0f}' for x in samples)})", flush=True)
    direct = run_direct(tokens, 3) * 2  # fp32 here: twice the bench's bf16 bytes
    for mode in ("layer", "chunk"):
        saved = results["none"] - results[mode]  # what overlapping took off the TTFT
        if not 0 <= saved <= direct:  # the no-overlap run is off by more than the transfer: no share to give
            print(f"  {mode}: {saved:.0f} ms faster than none, outside [0, transfer {direct:.0f} ms]: "
                  "the no-overlap run is not comparable; no hidden share")
            continue
        print(f"  transfer {direct:.1f} ms (direct stream, measured above): {mode}: "
              f"{100 * saved / direct:.0f}% hidden behind the prefill")


if __name__ == "__main__":
    main()
