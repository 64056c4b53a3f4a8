"""The prefix cache's index: which block holds which full block of tokens, named by a chained hash.

Hashes are looked up per KV-cache group (the same tokens in two groups are two blocks). The index only names
blocks; whether a named block is USED or CACHED, and when it is evicted, is the block states' concern
(engine/kv/block_states.py), and the pool (engine/kv/block_pool.py) keeps the two in step.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass, replace
from typing import Sequence

from engine.kv.block_states import BlockState, BlockStateError, BlockStates

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Stable 64-bit hash of one block's tokens chained with the previous block's hash.

    Uses blake2b over little-endian int32 tokens, so it is identical across processes and
    machines (unlike ``hash()``, which is salted per process).
    """
    tokens = array("i", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    digest = hashlib.blake2b(digest_size=8)
    digest.update(_NO_PARENT if parent is None else _HAS_PARENT + struct.pack("<Q", parent))
    digest.update(tokens.tobytes())
    return int.from_bytes(digest.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every FULL block of ``token_ids``; a trailing partial block is skipped."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Cumulative counters. Queries and hits are counted in blocks, so hits / queries is the block hit rate."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class PrefixIndex:
    """(group, hash) -> block and back, and the hit counters. Disabled, it finds nothing and holds nothing."""

    def __init__(self, num_groups: int, enabled: bool = True) -> None:
        self.num_groups = num_groups
        self.enabled = enabled
        self._hash_to_block: dict[tuple[int, int], int] = {}  # (group, hash) -> block
        self._block_to_key: dict[int, tuple[int, int]] = {}  # block -> (group, hash)
        self._depths: dict[int, int] = {}  # block -> its index in the prompt, where the registration said
        self._stats = PrefixCacheStats()

    def __contains__(self, block_id: int) -> bool:
        """Whether `block_id` is findable by its hash (so it is kept CACHED when its last reference goes)."""
        return block_id in self._block_to_key

    @property
    def stats(self) -> PrefixCacheStats:
        """A snapshot; mutating it does not affect the index."""
        return replace(self._stats)

    def hash_of(self, block_id: int) -> int | None:
        key = self._block_to_key.get(block_id)
        return None if key is None else key[1]

    def lookup(self, hashes: Sequence[int], group: int = 0) -> list[int | None]:
        """Per hash, the block of ``group`` holding it, or None (every None when disabled). A windowed group needs
        only the blocks inside its window, so it looks past gaps. Changes no state."""
        if not 0 <= group < self.num_groups:
            raise BlockStateError(f"group {group} outside 0..{self.num_groups - 1}")
        if not self.enabled:
            return [None] * len(hashes)
        return [self._hash_to_block.get((group, wanted)) for wanted in hashes]

    def find_cached_prefix(self, hashes: Sequence[int], group: int = 0) -> list[int]:
        """Blocks of ``group`` holding the longest leading run of ``hashes`` (USED or CACHED). Changes no block
        state; the hit counters count group 0's queries only (one query per block of the prompt)."""
        found: list[int] = []
        for block_id in self.lookup(hashes, group):
            if block_id is None:
                break
            found.append(block_id)
        if group == 0:
            self.record_prefix_query(len(hashes), len(found))
        return found

    def record_prefix_query(self, queried: int, hit: int) -> None:
        """Count a prefix query of `queried` blocks that `hit` blocks answered (a no-op when disabled)."""
        if self.enabled:
            self._stats.prefix_queries += queried
            self._stats.prefix_hits += hit

    def depth_of(self, block_id: int) -> int | None:
        """The index in its prompt of a named block (0: the first block), where its registration gave one."""
        return self._depths.get(block_id)

    def add(self, block_id: int, group: int, block_hash_: int, depth: int | None = None) -> bool:
        """Name `block_id` of `group` by `block_hash_` (at `depth` in its prompt, where known); False when another
        block already holds that key (it wins) or the index is disabled. A different hash for a named block is a
        BlockStateError."""
        if not self.enabled:
            return False
        current = self.hash_of(block_id)
        if current is not None and current != block_hash_:
            raise BlockStateError(f"block {block_id} already holds hash {current:#x}, not {block_hash_:#x}")
        key = (group, block_hash_)
        if key in self._hash_to_block:
            return False
        self._hash_to_block[key] = block_id
        self._block_to_key[block_id] = key
        if depth is not None:
            self._depths[block_id] = depth
        return True

    def evict(self, block_id: int) -> tuple[int, int | None]:
        """A CACHED block is taken for new content: it is no longer findable. Returns (its hash, its depth)."""
        key = self._block_to_key.pop(block_id)
        del self._hash_to_block[key]
        self._stats.evictions += 1
        return key[1], self._depths.pop(block_id, None)

    def named(self, group: int = 0) -> list[tuple[int, int, int | None]]:
        """(block, hash, depth) of every block of `group` the index names."""
        return [(b, h, self._depths.get(b)) for (g, h), b in self._hash_to_block.items() if g == group]

    def check(self, states: BlockStates) -> None:
        """Raise AssertionError unless both maps agree and name exactly USED or CACHED blocks of the key's
        group, and every CACHED block is named."""
        for key, block_id in self._hash_to_block.items():
            if self._block_to_key.get(block_id) != key:
                raise AssertionError(f"hash {key[1]:#x} -> block {block_id}, but reverse map disagrees")
            if states.group_of(block_id) != key[0]:
                raise AssertionError(f"hash {key[1]:#x} of group {key[0]} names block {block_id} of group "
                                     f"{states.group_of(block_id)}")
        if len(self._block_to_key) != len(self._hash_to_block):
            raise AssertionError(
                f"reverse map has {len(self._block_to_key)} entries, hash map {len(self._hash_to_block)}")
        stray_depths = sorted(set(self._depths) - set(self._block_to_key))
        if stray_depths:
            raise AssertionError(f"blocks {stray_depths} keep a depth but have no hash")
        hashed_elsewhere = sorted(set(self._block_to_key) - states.ids_in(BlockState.USED, BlockState.CACHED))
        if hashed_elsewhere:
            raise AssertionError(f"blocks {hashed_elsewhere} have hashes but are neither USED nor CACHED")
        unhashed_cached = sorted(states.ids_in(BlockState.CACHED) - set(self._block_to_key))
        if unhashed_cached:
            raise AssertionError(f"CACHED blocks {unhashed_cached} have no hash")
