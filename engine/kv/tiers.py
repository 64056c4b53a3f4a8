"""The KV tiers below one engine's pool: a host tier shared by the actors of a host, and a disk tier.

Keys. A tier entry is named by the block's hash in the prefix cache's chain (engine/kv/prefix_index.py: each
hash covers every token up to the block's end) and by the engine's namespace: a digest of the checkpoint's
identity (engine/model/identity.py), the serving and weight dtypes, the KV page format and the pool's page
layout. Two engines share entries exactly when the same tokens give them the same pages; another model, dtype or
KV format never reads them. Entries carry the hash, depth and a checksum (engine/kv/tier_store.py): a missing,
truncated or corrupt one is a miss, never wrong text.

Write-back. When the pool evicts a cached block (it leaves the LRU to take new content), `write_back` copies its
pages (every layer) into a buffer at once and the writer thread publishes it to each tier (engine/kv/
tier_writer.py). Only full, computed blocks are ever hashed, so only those are written; a tier entry appears
whole or not at all. At close the engine writes back what its pool still caches, so the disk tier outlives the
process with everything it computed.

Loads. At admission, after the pool's own prefix hit, `lookup` counts how many of the following blocks some tier
holds (the write queue first, then host, then disk) and `load_run` reads them into freshly allocated blocks,
all layers at once, block after block until one fails its checks or the deadline passes (`load_timeout`); what
was not loaded is computed. Loading is chosen whenever a tier holds the blocks: reading a block's pages is a
copy of a few hundred KiB, while computing them is a prefill of block_size tokens through every layer, far
dearer on a CPU. (On a GPU a host would keep the host tier in pinned memory and copy asynchronously, layer by
layer beside the prefill of the rest; here the copy runs on the step thread before the step.)

The router counts the prompt tokens the tiers hold as loaded, not computed, in its estimate of a colocated
request's TTFT (router/placer.py). Limits: a request handed off to a prefill actor takes only the pool's prefix
hit (its prefill actor computes the rest); an engine with tiers keeps the plain KV layout (one group of every
layer, nothing given back), since an entry is a block of every layer.

The interface per tier is `contains(hash, depth)`, `read(hash, depth, into)` and `write(hash, depth, payload)`;
this class maps blocks of the pool to payloads and keeps the counters.
"""
from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.kv.host_tier import HostTierDir
from engine.kv.tier_store import TierStore
from engine.kv.tier_writer import PendingBlock, TierWriter
from engine.model.identity import checkpoint_key

NAMESPACE_FORMAT = 1  # bump when what a payload holds changes
HOST, DISK = "host", "disk"
MAX_PENDING_BYTES = 256 << 20  # write-back queued for the tiers before further evictions are dropped
CLOSE_SECONDS = 10.0  # at close: how long the queued write-back may take


@dataclass
class TierCounters:
    """One tier's cumulative counts, in blocks and bytes."""

    queries: int = 0  # blocks looked up in this tier (past the pool and the tiers above it)
    hits: int = 0  # blocks loaded from it
    bytes_loaded: int = 0
    bytes_stored: int = 0


def _count_stored(counters: dict[str, TierCounters], tier: str, num_bytes: int) -> None:
    counters[tier].bytes_stored += num_bytes


def tier_namespace(config: EngineConfig, model_path, cache: KVCache) -> bytes:
    """The digest that keeps one engine's entries apart from every engine whose pages would differ."""
    data = cache.data
    key = {"format": NAMESPACE_FORMAT, "checkpoint": checkpoint_key(model_path), "dtype": str(cache.dtype),
           "weight_dtype": config.weight_dtype, "kv_format": cache.kv_format, "storage": str(data.dtype),
           "block_size": cache.block_size, "page": [data.shape[0], data.shape[1], *data.shape[3:]]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).digest()


def build_tiers(config: EngineConfig, model_path, cache: KVCache) -> "KVTiers | None":
    """The tiers `config` asks for (None when it asks for none). engine.kv.tier_store.TierError when one cannot
    be opened."""
    if not config.kv_host_size and not config.kv_disk_dir:
        return None
    namespace, stores, host_dir = tier_namespace(config, model_path, cache), [], None
    try:
        if config.kv_host_size:
            host_dir = HostTierDir.attach(config.kv_host_dir, config.kv_host_size, config.shm_free_bytes)
            stores.append(TierStore(HOST, host_dir.path, config.kv_host_size, namespace, time.time_ns))
        if config.kv_disk_dir:
            disk_dir = Path(config.kv_disk_dir).expanduser().resolve()
            stores.append(TierStore(DISK, disk_dir, config.kv_disk_size, namespace, time.time_ns))
    except BaseException:
        for store in stores:
            store.close()
        if host_dir is not None:
            host_dir.close()
        raise
    return KVTiers(cache, stores, host_dir, config.kv_tier_load_timeout)


class KVTiers:
    """The stores below one pool (host first, then disk), the write-back queue, and the counters."""

    def __init__(self, cache: KVCache, stores: list[TierStore], host_dir: HostTierDir | None, load_timeout: float,
                 clock: Callable[[], float] = time.monotonic, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.cache = cache
        self.stores = stores
        self.host_dir = host_dir
        self.load_timeout = load_timeout
        self.clock = clock
        self.counters = {store.name: TierCounters() for store in stores}
        self.writer = TierWriter(list(stores), max_pending_bytes, partial(_count_stored, self.counters))
        # Whoever never closes the engine (the embedded LLM) still gets its queued write-back published at exit
        self._stop_writer = weakref.finalize(self, self.writer.close, CLOSE_SECONDS)
        self.block_bytes = cache.bytes_per_block
        self._staging = bytearray(self.block_bytes)  # what a load reads into before it is checked
        self._closed = False

    @property
    def namespace(self) -> bytes:
        return self.stores[0].namespace

    # ---------------------------------------------------------------- lookup and loads (the step thread)

    def lookup(self, hashes: Sequence[int], first_depth: int) -> int:
        """How many leading blocks of `hashes` (the first at depth `first_depth`) some tier holds."""
        for i, block_hash in enumerate(hashes):
            if not self._find(block_hash, first_depth + i):
                return i
        return len(hashes)

    def _find(self, block_hash: int, depth: int) -> bool:
        if block_hash in self.writer.pending:  # on its way to the tiers: counted as the first tier's
            self.counters[self.stores[0].name].queries += 1
            return True
        for store in self.stores:
            self.counters[store.name].queries += 1
            if store.contains(block_hash, depth):
                return True
        return False

    def load_run(self, hashes: Sequence[int], first_depth: int, block_ids: Sequence[int]) -> int:
        """Load the blocks of `hashes` into `block_ids` in order, stopping at the first that fails or once the
        deadline (load_timeout from now) has passed; returns how many were loaded."""
        deadline = self.clock() + self.load_timeout
        for i, (block_hash, block_id) in enumerate(zip(hashes, block_ids)):
            if self.clock() > deadline or not self.load(block_hash, first_depth + i, block_id):
                return i
        return min(len(hashes), len(block_ids))

    def load(self, block_hash: int, depth: int, block_id: int) -> bool:
        """Fill pool block `block_id` with the block named `block_hash` from the first tier that holds it whole;
        False (the block untouched) when none does."""
        queued = self.writer.pending.get(block_hash)
        if queued is not None and queued.depth == depth:
            self._copy_in(queued.payload, block_id)
            self._count_load(self.stores[0].name)
            return True
        for store in self.stores:
            if store.read(block_hash, depth, self._staging):
                self._copy_in(self._staging, block_id)
                self._count_load(store.name)
                return True
        return False

    def _count_load(self, tier: str) -> None:
        counters = self.counters[tier]
        counters.hits += 1
        counters.bytes_loaded += self.block_bytes

    def _copy_in(self, payload: bytearray, block_id: int) -> None:
        self.cache.data[:, :, block_id].copy_(self._as_pages(payload))

    def _as_pages(self, payload: bytearray) -> torch.Tensor:
        data = self.cache.data
        return torch.frombuffer(payload, dtype=torch.uint8).view(data.dtype).view(*data.shape[:2], *data.shape[3:])

    # ---------------------------------------------------------------- write-back (the pool's eviction hook)

    def write_back(self, block_id: int, block_hash: int, depth: int | None, wait: float = 0.0) -> None:
        """Copy a cached block's pages out before the pool reuses it, and queue them for the tiers (waiting up to
        `wait` seconds for room in the queue: never on the step thread). A block whose depth in its prompt is
        unknown is not written (its entry could not be named)."""
        if depth is None or self._closed:
            return
        payload = bytearray(self.block_bytes)
        self._as_pages(payload).copy_(self.cache.data[:, :, block_id])
        self.writer.submit(PendingBlock(block_hash, depth, payload), wait)

    # ---------------------------------------------------------------- what the engine reports

    def describe(self) -> dict:
        """What another process needs to see which prompts these tiers hold (engine.kv.tier_store.stored_depth):
        the namespace, the block size and the directories."""
        return {"namespace": self.namespace.hex(), "block_size": self.cache.block_size,
                "dirs": [str(store.directory) for store in self.stores]}

    def stats(self) -> dict[str, int]:
        """EngineStats' tier fields: per tier its counters, bytes used (by every engine sharing it) and capacity."""
        out = {"kv_tier_dropped_stores": self.writer.dropped + sum(store.failed_writes for store in self.stores),
               "kv_tier_bad_entries": sum(store.bad_entries for store in self.stores)}
        for store in self.stores:
            c = self.counters[store.name]
            out |= {f"kv_{store.name}_queries": c.queries, f"kv_{store.name}_hits": c.hits,
                    f"kv_{store.name}_bytes_loaded": c.bytes_loaded, f"kv_{store.name}_bytes_stored": c.bytes_stored,
                    f"kv_{store.name}_bytes_used": store.usage(), f"kv_{store.name}_bytes_total": store.capacity}
        return out

    def flush(self, timeout: float = CLOSE_SECONDS) -> bool:
        """Wait until the queued write-back is published; False on timeout."""
        return self.writer.flush(timeout)

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Publish the queued write-back (within `timeout`), stop the writer, and let go of the stores; the host
        tier's owner removes its directory."""
        if self._closed:
            return
        self._closed = True
        self._stop_writer.detach()
        self.writer.close(timeout)
        for store in self.stores:
            store.close()
        if self.host_dir is not None:
            self.host_dir.close()
