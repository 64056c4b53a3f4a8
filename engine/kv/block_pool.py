"""Paged-KV block bookkeeping: a pool of block ids built from parts with one concern each.

Pure Python; the pool never touches tensors, it only decides which block ids hold what. Its parts:
- `states` (engine/kv/block_states.py): every block's state (FREE, CACHED, USED, RESERVED), the free list, the
  LRU of CACHED blocks, refcounts and each held block's KV-cache group;
- `prefix` (engine/kv/prefix_index.py): the prefix cache's hash index and its hit counters (lookups go there);
- `reservations` (engine/kv/reservations.py): blocks held for KV another process writes.
The pool's own methods are the changes that keep the parts in step (allocation evicts hashes, a release keeps
a findable block CACHED, a reservation takes blocks) and the counts that allocation and preemption read.

KV-cache groups (engine/kv/groups.py): a USED or CACHED block belongs to one group, whose layers' pages it
holds; a block is only ever acquired again into its own group. One pool, one free list: any group takes any
FREE block.
"""
from __future__ import annotations

from typing import Callable, Iterable

from engine.kv.block_states import BlockState, BlockStateError, BlockStates
from engine.kv.prefix_index import PrefixIndex
from engine.kv.reservations import Reservations


# Hears each cached block that allocation takes for new content, before anything overwrites it:
# (block id, its hash, its depth in its prompt or None). The KV tiers' write-back (engine/kv/tiers.py).
EvictionHook = Callable[[int, int, "int | None"], None]


class BlockPool:
    """Owns the state of block ids ``0..num_blocks-1``. Every operation is O(1) per block touched."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_groups: int = 1, on_evict: EvictionHook | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0 or num_groups <= 0:
            raise ValueError(f"num_blocks, block_size and num_groups must be positive, got {num_blocks}, "
                             f"{block_size}, {num_groups}")
        self.block_size = block_size
        self.on_evict = on_evict
        self.states = BlockStates(num_blocks, num_groups)
        self.prefix = PrefixIndex(num_groups, enable_prefix_caching)
        self.reservations = Reservations()

    # ---------------------------------------------------------------- accounting

    @property
    def num_blocks(self) -> int:
        return self.states.num_blocks

    @property
    def num_groups(self) -> int:
        return self.states.num_groups

    @property
    def num_free(self) -> int:
        return self.states.num_free

    @property
    def num_cached(self) -> int:
        return self.states.num_cached

    @property
    def num_used(self) -> int:
        """USED plus RESERVED blocks: everything that allocation cannot take."""
        return self.states.num_refcounted + self.reservations.num_reserved

    @property
    def num_available(self) -> int:
        return self.states.num_free + self.states.num_cached

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def block_state(self, block_id: int) -> BlockState:
        return self.states.state(block_id)

    def refcount(self, block_id: int) -> int:
        return self.states.refcount(block_id)

    # ---------------------------------------------------------------- allocation

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """Take ``n`` blocks (FREE first, then evicting CACHED in LRU order) as USED with refcount 1 in ``group``."""
        self.states.require_valid_group(group)
        block_ids = self._take_available(n)
        for block_id in block_ids:
            self.states.make_used(block_id, group)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id. At refcount 0 a hashed block becomes CACHED, others FREE.

        CACHED blocks join the LRU in the order given, so callers should pass a sequence's
        blocks in reverse (tail first): the tail is then evicted before the shared prefix.
        """
        block_ids = list(block_ids)
        self.states.check_freeable(block_ids)
        for block_id in block_ids:
            self.states.release(block_id, findable=block_id in self.prefix)

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on USED blocks (e.g. forking parallel samples off one prompt)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.block_state(block_id) is not BlockState.USED:
                raise BlockStateError(f"cannot share block {block_id}: it is {self.states.describe(block_id)}")
        for block_id in block_ids:
            self.states.add_ref(block_id)

    # ---------------------------------------------------------------- prefix caching

    def acquire(self, block_ids: Iterable[int], group: int = 0) -> None:
        """Take a reference on blocks of ``group`` found by ``prefix.find_cached_prefix`` or ``prefix.lookup``:
        CACHED -> USED(1), USED -> refcount+1."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.block_state(block_id) not in (BlockState.CACHED, BlockState.USED):
                raise BlockStateError(f"cannot acquire block {block_id}: it is {self.states.describe(block_id)}")
            if self.states.group_of(block_id) != group:
                raise BlockStateError(f"cannot acquire block {block_id} into group {group}: it holds group "
                                      f"{self.states.group_of(block_id)}")
        for block_id in block_ids:
            if self.states.state(block_id) is BlockState.CACHED:
                self.states.make_used(block_id, group)
            else:
                self.states.add_ref(block_id)

    def register(self, block_id: int, block_hash: int, depth: int | None = None) -> bool:
        """Record that USED full block ``block_id`` holds the content named ``block_hash`` (block ``depth`` of its
        prompt, where known: what names its entry in the KV tiers).

        Returns True if this call created the mapping. If another block already holds the hash,
        the existing mapping wins and ``block_id`` stays unregistered (it becomes FREE, not
        CACHED, when released) -- two copies of one prefix need only one findable entry.
        Registering the same hash twice is a no-op; a different hash for a hashed block is an error.
        A no-op returning False when prefix caching is disabled.
        """
        if not self.prefix.enabled:
            return False
        if self.block_state(block_id) is not BlockState.USED:
            raise BlockStateError(f"cannot register block {block_id}: it is {self.states.describe(block_id)}")
        return self.prefix.add(block_id, self.states.group_of(block_id), block_hash, depth)

    # ---------------------------------------------------------------- reservations

    def reserve(self, owner: str, n: int, deadline: float) -> list[int]:
        """Allocate ``n`` blocks as RESERVED for ``owner`` until ``deadline``; one reservation per owner."""
        if owner in self.reservations:
            raise BlockStateError(f"owner {owner!r} already holds a reservation")
        block_ids = self._take_available(n)
        for block_id in block_ids:
            self.states.make_reserved(block_id)
        self.reservations.add(owner, block_ids, deadline)
        return list(block_ids)

    def commit_reservation(self, owner: str) -> list[int]:
        """The KV has arrived: the reserved blocks become USED with refcount 1."""
        block_ids = self.reservations.pop(owner)
        for block_id in block_ids:
            self.states.make_used(block_id, 0)
        return block_ids

    def cancel_reservation(self, owner: str) -> bool:
        """Return the owner's reserved blocks to FREE. Idempotent: False if there was nothing to cancel."""
        if owner not in self.reservations:
            return False
        for block_id in self.reservations.pop(owner):
            self.states.make_free(block_id)
        return True

    def expire_reservations(self, now: float) -> list[str]:
        """Cancel every reservation whose deadline is <= ``now``; returns their owners."""
        expired = self.reservations.expired(now)
        for owner in expired:
            self.cancel_reservation(owner)
        return expired

    # ---------------------------------------------------------------- internals

    def _take_available(self, n: int) -> list[int]:
        """Remove ``n`` blocks from FREE, then from the LRU (dropping their hashes, after the eviction hook has
        heard of each); state left to caller."""
        taken, evicted = self.states.take(n)
        for block_id in evicted:
            block_hash, depth = self.prefix.evict(block_id)
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash, depth)
        return taken

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of any part or between them; a test and
        debugging aid (O(num_blocks))."""
        self.states.check(self.reservations.reserved_ids())
        self.prefix.check(self.states)


class TieredBlockPool(BlockPool):
    """A BlockPool (the hot blocks, ids ``0..num_blocks-1``) plus a cold region of compressed pages with ids
    ``num_blocks..num_blocks+num_cold-1``, so that one block table can mix both (--kv-compress).

    Allocation, prefix caching and reservations concern hot blocks only: a cold block is FREE or USED by
    exactly the one sequence whose page was compressed into it, and never findable by hash. The hash stays
    with the hot block the page came from, which is CACHED (findable, in full precision) until reused.
    ``num_used`` and ``num_blocks`` keep their hot meaning (what allocation and preemption see);
    ``num_compressed`` counts the cold blocks in use.
    """

    def __init__(self, num_blocks: int, num_cold: int, block_size: int, enable_prefix_caching: bool = True,
                 on_evict: EvictionHook | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, on_evict=on_evict)
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
        self.states.check_freeable(hot)
        self.cold.states.check_freeable(cold)
        super().free(hot)
        self.cold.free(cold)

    def share(self, block_ids: Iterable[int]) -> None:
        hot, cold = self._split(block_ids)
        for block_id in cold:
            if self.cold.block_state(block_id) is not BlockState.USED:
                raise BlockStateError(f"cannot share cold block {block_id + self.first_cold}: it is free")
        super().share(hot)
        self.cold.share(cold)

    def register(self, block_id: int, block_hash: int, depth: int | None = None) -> bool:
        """Cold blocks are never findable: their pages are lossy copies (their hot original may still be)."""
        return False if self.is_cold(block_id) else super().register(block_id, block_hash, depth)

    def block_state(self, block_id: int) -> BlockState:
        return self.cold.block_state(block_id - self.first_cold) if self.is_cold(block_id) else \
            super().block_state(block_id)

    def refcount(self, block_id: int) -> int:
        return self.cold.refcount(block_id - self.first_cold) if self.is_cold(block_id) else super().refcount(block_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.cold.check_integrity()
        if self.cold.num_cached or self.cold.reservations.owners():
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
