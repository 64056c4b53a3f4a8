"""Paged-KV block bookkeeping: allocation, refcounts, prefix caching and reservations.

Pure Python; the pool never touches tensors, it only decides which block ids hold what.

Every block is in exactly one state:

* FREE     -- holds nothing worth keeping; first choice for allocation.
* CACHED   -- refcount 0 but holds a full block registered under its chained hash, so a
              prefix lookup can still revive it; evicted least-recently-freed first.
* USED     -- refcount >= 1.
* RESERVED -- held for a request whose KV arrives from another process (an owner and a deadline).

KV-cache groups (engine/kv/groups.py): a USED or CACHED block belongs to one group, whose layers' pages it
holds; prefix hashes are looked up per group (the same tokens in two groups are two blocks), and a block
is only ever acquired again into its own group. One pool, one free list: any group takes any FREE block.
"""
from __future__ import annotations

import enum
import hashlib
import struct
import sys
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    """Fewer blocks are available (FREE + CACHED) than were requested; nothing was changed."""


class BlockStateError(ValueError):
    """An operation was applied to a block or reservation in the wrong state; nothing was changed."""


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    USED = "used"
    RESERVED = "reserved"


@dataclass
class PrefixCacheStats:
    """Cumulative counters. Queries and hits are counted in blocks, so hits / queries is the block hit rate."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class _Reservation:
    block_ids: list[int]
    deadline: float


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


class BlockPool:
    """Owns the state of block ids ``0..num_blocks-1``. Every operation is O(1) per block touched."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_groups: int = 1) -> None:
        if num_blocks <= 0 or block_size <= 0 or num_groups <= 0:
            raise ValueError(f"num_blocks, block_size and num_groups must be positive, got {num_blocks}, "
                             f"{block_size}, {num_groups}")
        self._num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_groups = num_groups
        self._groups: dict[int, int] = {}  # exactly the USED and CACHED blocks -> the group they hold pages of
        self._used_per_group = [0] * num_groups
        self._states = [BlockState.FREE] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently freed first
        self._refcounts: dict[int, int] = {}  # exactly the USED blocks
        self._hash_to_block: dict[tuple[int, int], int] = {}  # (group, hash) -> block
        self._block_to_hash: dict[int, int] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._num_reserved = 0
        self._stats = PrefixCacheStats()

    # ---------------------------------------------------------------- accounting

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """USED plus RESERVED blocks: everything that allocation cannot take."""
        return len(self._refcounts) + self._num_reserved

    @property
    def num_available(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def usage(self) -> float:
        return self.num_used / self._num_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        """A snapshot; mutating it does not affect the pool."""
        return replace(self._stats)

    def num_used_in(self, group: int) -> int:
        """USED blocks holding pages of `group` (reservations not included)."""
        return self._used_per_group[group]

    def group_of(self, block_id: int) -> int | None:
        """The group a USED or CACHED block holds pages of; None for FREE and RESERVED blocks."""
        return self._groups.get(block_id)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def block_state(self, block_id: int) -> BlockState:
        self._require_valid_id(block_id)
        return self._states[block_id]

    def refcount(self, block_id: int) -> int:
        self._require_valid_id(block_id)
        return self._refcounts.get(block_id, 0)

    def hash_of(self, block_id: int) -> int | None:
        return self._block_to_hash.get(block_id)

    # ---------------------------------------------------------------- allocation

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take ``n`` blocks (FREE first, then evicting CACHED in LRU order) as USED with refcount 1 in ``group``."""
        self._require_valid_group(group)
        block_ids = self._take_available(n)
        for block_id in block_ids:
            self._make_used(block_id, group)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id. At refcount 0 a hashed block becomes CACHED, others FREE.

        CACHED blocks join the LRU in the order given, so callers should pass a sequence's
        blocks in reverse (tail first): the tail is then evicted before the shared prefix.
        """
        block_ids = list(block_ids)
        self._check_freeable(block_ids)
        for block_id in block_ids:
            self._release_one(block_id)

    def _check_freeable(self, block_ids: list[int]) -> None:
        for block_id, count in Counter(block_ids).items():
            if self.refcount(block_id) < count:
                raise BlockStateError(f"block {block_id} freed {count}x but is {self._describe(block_id)}")

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on USED blocks (e.g. forking parallel samples off one prompt)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.block_state(block_id) is not BlockState.USED:
                raise BlockStateError(f"cannot share block {block_id}: it is {self._describe(block_id)}")
        for block_id in block_ids:
            self._refcounts[block_id] += 1

    # ---------------------------------------------------------------- prefix caching

    def find_cached_prefix(self, hashes: Sequence[int], group: int = 0) -> list[int]:
        """Blocks of ``group`` holding the longest leading run of ``hashes`` (USED or CACHED). Changes no
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
        """Count a prefix query of `queried` blocks that `hit` blocks answered (a no-op without prefix caching)."""
        if self.enable_prefix_caching:
            self._stats.prefix_queries += queried
            self._stats.prefix_hits += hit

    def lookup(self, hashes: Sequence[int], group: int = 0) -> list[int | None]:
        """Per hash, the block of ``group`` holding it, or None (every None without prefix caching). A
        windowed group needs only the blocks inside its window, so it looks past gaps. Changes no state."""
        self._require_valid_group(group)
        if not self.enable_prefix_caching:
            return [None] * len(hashes)
        return [self._hash_to_block.get((group, wanted)) for wanted in hashes]

    def acquire(self, block_ids: Iterable[int], group: int = 0) -> None:
        """Take a reference on blocks of ``group`` from ``find_cached_prefix`` or ``lookup``: CACHED -> USED(1),
        USED -> refcount+1."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.block_state(block_id) not in (BlockState.CACHED, BlockState.USED):
                raise BlockStateError(f"cannot acquire block {block_id}: it is {self._describe(block_id)}")
            if self._groups[block_id] != group:
                raise BlockStateError(f"cannot acquire block {block_id} into group {group}: it holds group "
                                      f"{self._groups[block_id]}")
        for block_id in block_ids:
            if self._states[block_id] is BlockState.CACHED:
                del self._lru[block_id]
                self._make_used(block_id, group)
            else:
                self._refcounts[block_id] += 1

    def register(self, block_id: int, block_hash: int) -> bool:
        """Record that USED full block ``block_id`` holds the content named ``block_hash``.

        Returns True if this call created the mapping. If another block already holds the hash,
        the existing mapping wins and ``block_id`` stays unregistered (it becomes FREE, not
        CACHED, when released) -- two copies of one prefix need only one findable entry.
        Registering the same hash twice is a no-op; a different hash for a hashed block is an error.
        A no-op returning False when prefix caching is disabled.
        """
        if not self.enable_prefix_caching:
            return False
        if self.block_state(block_id) is not BlockState.USED:
            raise BlockStateError(f"cannot register block {block_id}: it is {self._describe(block_id)}")
        current = self._block_to_hash.get(block_id)
        if current is not None and current != block_hash:
            raise BlockStateError(f"block {block_id} already holds hash {current:#x}, not {block_hash:#x}")
        key = (self._groups[block_id], block_hash)
        if key in self._hash_to_block:
            return False
        self._hash_to_block[key] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    # ---------------------------------------------------------------- reservations

    def reserve(self, owner: str, n: int, deadline: float) -> list[int]:
        """Allocate ``n`` blocks as RESERVED for ``owner`` until ``deadline``; one reservation per owner."""
        if owner in self._reservations:
            raise BlockStateError(f"owner {owner!r} already holds a reservation")
        block_ids = self._take_available(n)
        for block_id in block_ids:
            self._states[block_id] = BlockState.RESERVED
        self._reservations[owner] = _Reservation(block_ids, deadline)
        self._num_reserved += len(block_ids)
        return list(block_ids)

    def commit_reservation(self, owner: str) -> list[int]:
        """The KV has arrived: the reserved blocks become USED with refcount 1."""
        reservation = self._pop_reservation(owner)
        for block_id in reservation.block_ids:
            self._make_used(block_id, 0)
        return reservation.block_ids

    def cancel_reservation(self, owner: str) -> bool:
        """Return the owner's reserved blocks to FREE. Idempotent: False if there was nothing to cancel."""
        if owner not in self._reservations:
            return False
        for block_id in self._pop_reservation(owner).block_ids:
            self._make_free(block_id)
        return True

    def expire_reservations(self, now: float) -> list[str]:
        """Cancel every reservation whose deadline is <= ``now``; returns their owners."""
        expired = [owner for owner, res in self._reservations.items() if res.deadline <= now]
        for owner in expired:
            self.cancel_reservation(owner)
        return expired

    def reserved_blocks(self, owner: str) -> list[int]:
        reservation = self._reservations.get(owner)
        return [] if reservation is None else list(reservation.block_ids)

    def reserved_owners(self) -> list[str]:
        return list(self._reservations)

    # ---------------------------------------------------------------- internals

    def _take_available(self, n: int) -> list[int]:
        """Remove ``n`` blocks from FREE, then from the LRU (dropping their hashes); state left to caller."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            raise NoFreeBlocksError(f"requested {n} blocks, only {self.num_available} available")
        taken = [self._free.popitem(last=False)[0] for _ in range(min(n, len(self._free)))]
        while len(taken) < n:
            taken.append(self._evict_lru())
        return taken

    def _evict_lru(self) -> int:
        block_id, _ = self._lru.popitem(last=False)
        del self._hash_to_block[(self._groups.pop(block_id), self._block_to_hash.pop(block_id))]
        self._stats.evictions += 1
        return block_id

    def _release_one(self, block_id: int) -> None:
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] > 0:
            return
        del self._refcounts[block_id]
        self._used_per_group[self._groups[block_id]] -= 1
        if block_id in self._block_to_hash:
            self._states[block_id] = BlockState.CACHED
            self._lru[block_id] = None
        else:
            self._make_free(block_id)

    def _make_used(self, block_id: int, group: int) -> None:
        self._states[block_id] = BlockState.USED
        self._refcounts[block_id] = 1
        self._groups[block_id] = group
        self._used_per_group[group] += 1

    def _make_free(self, block_id: int) -> None:
        self._states[block_id] = BlockState.FREE
        self._free[block_id] = None
        self._groups.pop(block_id, None)

    def _pop_reservation(self, owner: str) -> _Reservation:
        if owner not in self._reservations:
            raise BlockStateError(f"owner {owner!r} holds no reservation")
        reservation = self._reservations.pop(owner)
        self._num_reserved -= len(reservation.block_ids)
        return reservation

    def _require_valid_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise BlockStateError(f"block id {block_id} outside 0..{self._num_blocks - 1}")

    def _require_valid_group(self, group: int) -> None:
        if not 0 <= group < self.num_groups:
            raise BlockStateError(f"group {group} outside 0..{self.num_groups - 1}")

    def _describe(self, block_id: int) -> str:
        state = self._states[block_id]
        return f"{state.value} (refcount {self._refcounts[block_id]})" if state is BlockState.USED else state.value

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant; a test and debugging aid (O(num_blocks))."""
        reserved = self._reserved_ids_checked()
        self._check_container_matches_state("free list", list(self._free), BlockState.FREE)
        self._check_container_matches_state("LRU", list(self._lru), BlockState.CACHED)
        self._check_container_matches_state("refcount map", list(self._refcounts), BlockState.USED)
        self._check_container_matches_state("reservations", reserved, BlockState.RESERVED)
        total = len(self._free) + len(self._lru) + len(self._refcounts) + len(reserved)
        if total != self._num_blocks:
            raise AssertionError(f"free+cached+used+reserved = {total}, expected {self._num_blocks}")
        bad_refcounts = {b: c for b, c in self._refcounts.items() if c < 1}
        if bad_refcounts:
            raise AssertionError(f"USED blocks with refcount < 1: {bad_refcounts}")
        self._check_hash_maps()
        self._check_groups()

    def _reserved_ids_checked(self) -> list[int]:
        reserved = [b for res in self._reservations.values() for b in res.block_ids]
        if len(reserved) != self._num_reserved:
            raise AssertionError(f"reserved counter {self._num_reserved} != {len(reserved)} reserved ids")
        return reserved

    def _check_container_matches_state(self, name: str, block_ids: list[int], state: BlockState) -> None:
        duplicates = sorted(b for b, count in Counter(block_ids).items() if count > 1)
        if duplicates:
            raise AssertionError(f"{name} contains duplicate ids {duplicates}")
        expected = {b for b, s in enumerate(self._states) if s is state}
        if set(block_ids) != expected:
            raise AssertionError(
                f"{name} holds {sorted(set(block_ids) - expected)} not in state {state.value} "
                f"and misses {sorted(expected - set(block_ids))} that are")

    def _check_hash_maps(self) -> None:
        for (group, block_hash_), block_id in self._hash_to_block.items():
            if self._block_to_hash.get(block_id) != block_hash_:
                raise AssertionError(f"hash {block_hash_:#x} -> block {block_id}, but reverse map disagrees")
            if self._groups.get(block_id) != group:
                raise AssertionError(f"hash {block_hash_:#x} of group {group} names block {block_id} of group "
                                     f"{self._groups.get(block_id)}")
        if len(self._block_to_hash) != len(self._hash_to_block):
            raise AssertionError(
                f"reverse map has {len(self._block_to_hash)} entries, hash map {len(self._hash_to_block)}")
        hashed_elsewhere = sorted(b for b in self._block_to_hash
                                  if self._states[b] not in (BlockState.USED, BlockState.CACHED))
        if hashed_elsewhere:
            raise AssertionError(f"blocks {hashed_elsewhere} have hashes but are neither USED nor CACHED")
        unhashed_cached = sorted(b for b in self._lru if b not in self._block_to_hash)
        if unhashed_cached:
            raise AssertionError(f"CACHED blocks {unhashed_cached} have no hash")

    def _check_groups(self) -> None:
        holding = {b for b, s in enumerate(self._states) if s in (BlockState.USED, BlockState.CACHED)}
        if set(self._groups) != holding:
            raise AssertionError(f"group map names {sorted(set(self._groups) ^ holding)} wrongly: it must hold "
                                 "exactly the USED and CACHED blocks")
        stray = sorted(b for b, g in self._groups.items() if not 0 <= g < self.num_groups)
        if stray:
            raise AssertionError(f"blocks {stray} name a group outside 0..{self.num_groups - 1}")
        counted = Counter(self._groups[b] for b in self._refcounts)
        expected = [counted.get(g, 0) for g in range(self.num_groups)]
        if self._used_per_group != expected:
            raise AssertionError(f"USED per group counted {self._used_per_group}, the blocks say {expected}")


class TieredBlockPool(BlockPool):
    """A BlockPool (the hot blocks, ids ``0..num_blocks-1``) plus a cold region of compressed pages with ids
    ``num_blocks..num_blocks+num_cold-1``, so that one block table can mix both (--kv-compress).

    Allocation, prefix caching and reservations concern hot blocks only: a cold block is FREE or USED by
    exactly the one sequence whose page was compressed into it, and never findable by hash. The hash stays
    with the hot block the page came from, which is CACHED (findable, in full precision) until reused.
    ``num_used`` and ``num_blocks`` keep their hot meaning (what allocation and preemption see);
    ``num_compressed`` counts the cold blocks in use.
    """

    def __init__(self, num_blocks: int, num_cold: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.cold = BlockPool(num_cold, block_size, enable_prefix_caching=False)

    @property
    def first_cold(self) -> int:
        return self.num_blocks

    @property
    def num_compressed(self) -> int:
        return self.cold.num_used

    def is_cold(self, block_id: int) -> bool:
        return block_id >= self.first_cold

    def allocate_cold(self, n: int) -> list[int]:
        """Take ``n`` cold blocks (USED, refcount 1); raises NoFreeBlocksError, changing nothing, if too few."""
        return [self.first_cold + b for b in self.cold.allocate(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        """As BlockPool.free, for a mix of hot and cold ids; all are checked before any is released."""
        hot, cold = self._split(block_ids)
        self._check_freeable(hot)
        self.cold._check_freeable(cold)
        super().free(hot)
        self.cold.free(cold)

    def share(self, block_ids: Iterable[int]) -> None:
        hot, cold = self._split(block_ids)
        for block_id in cold:
            if self.cold.block_state(block_id) is not BlockState.USED:
                raise BlockStateError(f"cannot share cold block {block_id + self.first_cold}: it is free")
        super().share(hot)
        self.cold.share(cold)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Cold blocks are never findable: their pages are lossy copies (their hot original may still be)."""
        return False if self.is_cold(block_id) else super().register(block_id, block_hash)

    def block_state(self, block_id: int) -> BlockState:
        return self.cold.block_state(block_id - self.first_cold) if self.is_cold(block_id) else \
            super().block_state(block_id)

    def refcount(self, block_id: int) -> int:
        return self.cold.refcount(block_id - self.first_cold) if self.is_cold(block_id) else super().refcount(block_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.cold.check_integrity()
        if self.cold.num_cached or self.cold.reserved_owners():
            raise AssertionError("the cold region holds cached or reserved blocks; it may hold only free and used")

    def _split(self, block_ids: Iterable[int]) -> tuple[list[int], list[int]]:
        """(hot ids, cold ids relative to the cold region), each in the given order."""
        hot, cold = [], []
        for block_id in block_ids:
            if block_id >= self.first_cold:
                cold.append(block_id - self.first_cold)
            else:
                hot.append(block_id)
        return hot, cold
