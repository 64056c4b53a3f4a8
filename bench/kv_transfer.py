"""KV hand-off cost: shared memory (what actors on one host use) and TCP loopback (actors on other hosts),
against a plain memory copy of the same bytes in the same run.

    python -m bench.kv_transfer [--tokens 1024,8192,32768] [--repeats 5]

Geometry is SmolLM2-135M's (30 layers, 3 KV heads x 64, bf16: 23,040 bytes per token). Per size it reports:
- memcpy: one torch copy of the prompt's KV bytes (the bound for anything that moves them);
- shm write+verify: another process writes the pages into the exported pool and reports ready with the
  hand-off fingerprint; the owner verifies it;
- shm protocol only: the same without the page write. This is what the zero-copy path adds to a prefill,
  since a prefill actor writes each layer's KV in place as it computes it;
- tcp: the pages streamed layer by layer as KVPages frames over authenticated loopback TCP and written
  into the receiver's pool (KVCache.read_pages / write_pages, as a prefill actor and a decode actor on
  another host do; in the server the frames take one more local hop, prefill actor -> router).
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
from dataclasses import dataclass

import torch

from engine.kv.export import create_shared_pool, open_shared_pool
from engine.config import ModelConfig
from engine.kv.cache import KVCache
from transport import connect_tcp, serve_tcp
from transport import messages as m

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

    def line(self) -> str:
        gbps = lambda ms: self.mbytes / 1e3 / (ms / 1e3)  # noqa: E731
        return (f"{self.tokens:>7} {self.mbytes:>9.1f} {self.memcpy_ms:>9.2f} ({gbps(self.memcpy_ms):5.2f} GB/s) "
                f"{self.shm_write_verify_ms:>9.2f} ({gbps(self.shm_write_verify_ms):5.2f} GB/s) "
                f"{self.shm_protocol_ms:>9.2f} {self.tcp_ms:>9.2f} ({gbps(self.tcp_ms):5.2f} GB/s)")


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
    pool = create_shared_pool(pool_shape(nblocks), DTYPE, tag="bench")
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
        pool.unlink()


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
    conn = await connect_tcp(*server.address, secret)
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
        await server.close()
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; bytes per token {LAYERS * 2 * HEADS * HEAD_DIM * 2}")
    print(f"{'tokens':>7} {'MB':>9} {'memcpy ms':>22} {'shm write+verify ms':>22} {'shm proto ms':>9} "
          f"{'tcp ms':>22}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        mbytes = LAYERS * 2 * -(-tokens // BLOCK) * BLOCK * HEADS * HEAD_DIM * 2 / 1e6
        row = Row(tokens, mbytes, run_memcpy(tokens, args.repeats), run_shm(tokens, args.repeats, True),
                  run_shm(tokens, args.repeats, False), asyncio.run(run_tcp(tokens, args.repeats)))
        print(row.line(), flush=True)


if __name__ == "__main__":
    main()
