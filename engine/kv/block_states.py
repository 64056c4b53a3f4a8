"""The state of every block id of a pool and the containers that make each change O(1).

Every block is in exactly one state:

* FREE     -- holds nothing worth keeping; first choice for allocation.
* CACHED   -- refcount 0 but holds a full block the prefix index can still find; evicted least-recently-freed first.
* USED     -- refcount >= 1.
* RESERVED -- held for a request whose KV arrives from another process (engine/kv/reservations.py).

A USED or CACHED block belongs to one KV-cache group (engine/kv/groups.py), whose layers' pages it holds.
Which content a block holds is the prefix index's concern, not this part's: a release says whether the block
stays findable.
"""
from __future__ import annotations

import enum
from collections import Counter, OrderedDict


class NoFreeBlocksError(RuntimeError):
    """Fewer blocks are available (FREE + CACHED) than were requested; nothing was changed."""


class BlockStateError(ValueError):
    """An operation was applied to a block or reservation in the wrong state; nothing was changed."""


class BlockState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    USED = "used"
    RESERVED = "reserved"


class BlockStates:
    """The free list, the LRU of CACHED blocks, the refcounts of USED blocks and each held block's group."""

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self._states = [BlockState.FREE] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # CACHED blocks, least recently freed first
        self._refcounts: dict[int, int] = {}  # exactly the USED blocks
        self._groups: dict[int, int] = {}  # exactly the USED and CACHED blocks -> the group they hold pages of
        self._used_per_group = [0] * num_groups

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_refcounted(self) -> int:
        """USED blocks (reservations not included)."""
        return len(self._refcounts)

    def state(self, block_id: int) -> BlockState:
        self._require_valid_id(block_id)
        return self._states[block_id]

    def refcount(self, block_id: int) -> int:
        self._require_valid_id(block_id)
        return self._refcounts.get(block_id, 0)

    def group_of(self, block_id: int) -> int | None:
        """The group a USED or CACHED block holds pages of; None for FREE and RESERVED blocks."""
        return self._groups.get(block_id)

    def num_used_in(self, group: int) -> int:
        """USED blocks holding pages of `group` (reservations not included)."""
        return self._used_per_group[group]

    def require_valid_group(self, group: int) -> None:
        if not 0 <= group < self.num_groups:
            raise BlockStateError(f"group {group} outside 0..{self.num_groups - 1}")

    def describe(self, block_id: int) -> str:
        state = self._states[block_id]
        return f"{state.value} (refcount {self._refcounts[block_id]})" if state is BlockState.USED else state.value

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """Remove `n` blocks from FREE, then from the LRU; (taken, the CACHED ones among them). The caller sets
        their state and drops the evicted blocks' hashes."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        available = len(self._free) + len(self._lru)
        if n > available:
            raise NoFreeBlocksError(f"requested {n} blocks, only {available} available")
        taken = [self._free.popitem(last=False)[0] for _ in range(min(n, len(self._free)))]
        evicted = [self._lru.popitem(last=False)[0] for _ in range(n - len(taken))]
        for block_id in evicted:
            del self._groups[block_id]
        return taken + evicted, evicted

    def check_freeable(self, block_ids: list[int]) -> None:
        """BlockStateError unless every id holds at least as many references as it appears in `block_ids`."""
        for block_id, count in Counter(block_ids).items():
            if self.refcount(block_id) < count:
                raise BlockStateError(f"block {block_id} freed {count}x but is {self.describe(block_id)}")

    def make_used(self, block_id: int, group: int) -> None:
        """A taken, reserved or CACHED block becomes USED with refcount 1 in `group`."""
        self._lru.pop(block_id, None)
        self._states[block_id] = BlockState.USED
        self._refcounts[block_id] = 1
        self._groups[block_id] = group
        self._used_per_group[group] += 1

    def make_free(self, block_id: int) -> None:
        self._states[block_id] = BlockState.FREE
        self._free[block_id] = None
        self._groups.pop(block_id, None)

    def make_reserved(self, block_id: int) -> None:
        self._states[block_id] = BlockState.RESERVED

    def add_ref(self, block_id: int) -> None:
        self._refcounts[block_id] += 1

    def release(self, block_id: int, findable: bool) -> None:
        """Drop one reference; at refcount 0 the block becomes CACHED if its content is `findable`, else FREE."""
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] > 0:
            return
        del self._refcounts[block_id]
        self._used_per_group[self._groups[block_id]] -= 1
        if findable:
            self._states[block_id] = BlockState.CACHED
            self._lru[block_id] = None
        else:
            self.make_free(block_id)

    def ids_in(self, *states: BlockState) -> set[int]:
        return {b for b, s in enumerate(self._states) if s in states}

    def check(self, reserved: list[int]) -> None:
        """Raise AssertionError naming the first broken invariant of these containers, given the RESERVED ids."""
        self._check_container("free list", list(self._free), BlockState.FREE)
        self._check_container("LRU", list(self._lru), BlockState.CACHED)
        self._check_container("refcount map", list(self._refcounts), BlockState.USED)
        self._check_container("reservations", reserved, BlockState.RESERVED)
        total = len(self._free) + len(self._lru) + len(self._refcounts) + len(reserved)
        if total != self.num_blocks:
            raise AssertionError(f"free+cached+used+reserved = {total}, expected {self.num_blocks}")
        bad_refcounts = {b: c for b, c in self._refcounts.items() if c < 1}
        if bad_refcounts:
            raise AssertionError(f"USED blocks with refcount < 1: {bad_refcounts}")
        self._check_groups()

    def _check_container(self, name: str, block_ids: list[int], state: BlockState) -> None:
        duplicates = sorted(b for b, count in Counter(block_ids).items() if count > 1)
        if duplicates:
            raise AssertionError(f"{name} contains duplicate ids {duplicates}")
        expected = self.ids_in(state)
        if set(block_ids) != expected:
            raise AssertionError(
                f"{name} holds {sorted(set(block_ids) - expected)} not in state {state.value} "
                f"and misses {sorted(expected - set(block_ids))} that are")

    def _check_groups(self) -> None:
        holding = self.ids_in(BlockState.USED, BlockState.CACHED)
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

    def _require_valid_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockStateError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
