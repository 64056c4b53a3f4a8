"""Tests for engine.kv.block_pool: unit tests per rule, hash properties, and a stateful model check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_pool import BlockPool
from engine.kv.block_states import BlockState, BlockStateError, NoFreeBlocksError
from engine.kv.prefix_index import block_hash, prefix_block_hashes

REPO_ROOT = Path(__file__).resolve().parent.parent


def _filled_cached_pool(num_blocks: int = 4) -> tuple[BlockPool, list[int], list[int]]:
    """A pool whose blocks are all allocated, registered under distinct hashes, then freed in id order."""
    pool = BlockPool(num_blocks, block_size=4)
    ids = pool.allocate(num_blocks)
    hashes = prefix_block_hashes(list(range(4 * num_blocks)), 4)
    for block_id, h in zip(ids, hashes):
        assert pool.register(block_id, h)
    pool.free(ids)
    return pool, ids, hashes


# ---------------------------------------------------------------- hashing

def test_prefix_hashes_cover_only_full_blocks() -> None:
    assert len(prefix_block_hashes(list(range(11)), 4)) == 2
    assert prefix_block_hashes(list(range(3)), 4) == []
    assert len(prefix_block_hashes(list(range(12)), 4)) == 3


def test_prefix_hashes_are_chained() -> None:
    hashes = prefix_block_hashes([1, 2, 3, 4, 5, 6], 3)
    assert hashes == [block_hash(None, [1, 2, 3]), block_hash(hashes[0], [4, 5, 6])]
    assert block_hash(None, [4, 5, 6]) != hashes[1]


def test_none_parent_differs_from_zero_parent() -> None:
    assert block_hash(None, [1, 2]) != block_hash(0, [1, 2])


def test_hash_accepts_any_int_sequence() -> None:
    assert block_hash(7, (1, 2, 3)) == block_hash(7, [1, 2, 3]) == block_hash(7, range(1, 4))


@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=40), st.lists(st.integers(0, 50), max_size=10))
def test_identical_prefixes_give_identical_chains(prefix: list[int], suffix: list[int]) -> None:
    block_size = 4
    full = len(prefix) // block_size
    assert prefix_block_hashes(prefix + suffix, block_size)[:full] == prefix_block_hashes(prefix, block_size)


@given(st.lists(st.integers(0, 1000), min_size=4, max_size=40), st.data())
def test_changing_a_token_changes_its_block_and_all_later_ones(tokens: list[int], data: st.DataObject) -> None:
    block_size = 4
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = tokens.copy()
    changed[position] += 1
    before, after = prefix_block_hashes(tokens, block_size), prefix_block_hashes(changed, block_size)
    first_affected = position // block_size
    assert before[:first_affected] == after[:first_affected]
    assert all(a != b for a, b in zip(before[first_affected:], after[first_affected:]))


@pytest.mark.process
def test_hashes_are_stable_across_processes_with_different_hash_seeds() -> None:
    token_lists = [list(range(40)), [5] * 17, [2**31 - 1, 0, 123456, 7] * 3]
    script = (
        "import json, sys\n"
        "from engine.kv.prefix_index import prefix_block_hashes\n"
        "print(json.dumps([prefix_block_hashes(t, 4) for t in json.loads(sys.argv[1])]))\n"
    )
    outputs = []
    for seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", script, json.dumps(token_lists)],
                                env=env, capture_output=True, text=True, cwd=REPO_ROOT)
        assert result.returncode == 0, result.stderr
        outputs.append(json.loads(result.stdout))
    local = [prefix_block_hashes(t, 4) for t in token_lists]
    assert outputs[0] == outputs[1] == local
    assert all(h > 0 for hashes in local for h in hashes)


# ---------------------------------------------------------------- allocation and free

def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(8, 16)
    assert (pool.num_blocks, pool.num_free, pool.num_cached, pool.num_used) == (8, 8, 0, 0)
    assert pool.usage == 0.0 and pool.num_available == 8
    pool.check_integrity()


def test_allocate_returns_distinct_used_blocks() -> None:
    pool = BlockPool(8, 16)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5
    assert all(pool.block_state(b) is BlockState.USED and pool.refcount(b) == 1 for b in ids)
    assert (pool.num_free, pool.num_used, pool.usage) == (3, 5, 5 / 8)
    pool.check_integrity()


def test_allocate_too_many_raises_without_side_effects() -> None:
    pool, _, hashes = _filled_cached_pool(4)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (0, 3, 1)
    assert len(pool.prefix.find_cached_prefix(hashes[1:])) == 3
    assert pool.prefix.stats.evictions == 1
    assert not pool.can_allocate(4) and pool.can_allocate(3)


def test_allocate_rejects_negative_and_accepts_zero() -> None:
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_allocate_prefers_free_over_cached() -> None:
    pool = BlockPool(4, 4)
    cached = pool.allocate(2)
    for block_id, h in zip(cached, prefix_block_hashes(list(range(8)), 4)):
        pool.register(block_id, h)
    pool.free(cached)
    assert set(pool.allocate(2)).isdisjoint(cached)
    assert pool.num_cached == 2 and pool.prefix.stats.evictions == 0


def test_eviction_follows_free_order_and_drops_hash() -> None:
    pool, ids, hashes = _filled_cached_pool(4)
    assert pool.num_cached == 4 and pool.num_free == 0
    assert pool.allocate(1) == [ids[0]]
    assert pool.prefix.hash_of(ids[0]) is None
    assert pool.prefix.find_cached_prefix(hashes) == []
    assert pool.prefix.find_cached_prefix(hashes[1:]) == ids[1:]
    assert pool.prefix.stats.evictions == 1
    pool.check_integrity()


def test_freeing_sequence_in_reverse_evicts_tail_first() -> None:
    pool = BlockPool(3, 4)
    ids = pool.allocate(3)
    for block_id, h in zip(ids, prefix_block_hashes(list(range(12)), 4)):
        pool.register(block_id, h)
    pool.free(reversed(ids))
    assert pool.allocate(1) == [ids[2]]
    assert pool.allocate(1) == [ids[1]]


def test_free_unregistered_block_goes_to_free() -> None:
    pool = BlockPool(2, 4)
    pool.free(pool.allocate(2))
    assert (pool.num_free, pool.num_cached) == (2, 0)


def test_free_of_non_used_block_raises_without_side_effects() -> None:
    pool = BlockPool(4, 4)
    a, b = pool.allocate(2)
    with pytest.raises(BlockStateError):
        pool.free([a, 3])
    assert pool.refcount(a) == 1
    with pytest.raises(BlockStateError):
        pool.free([b, b])
    assert pool.refcount(b) == 1
    with pytest.raises(BlockStateError):
        pool.free([99])
    pool.check_integrity()


def test_share_increments_and_free_releases_last_reference() -> None:
    pool = BlockPool(4, 4)
    ids = pool.allocate(2)
    pool.share(ids)
    pool.share(ids[:1])
    assert [pool.refcount(b) for b in ids] == [3, 2]
    pool.free(ids)
    assert pool.num_used == 2
    pool.free(ids)
    assert pool.num_used == 1 and pool.block_state(ids[1]) is BlockState.FREE
    pool.free(ids[:1])
    assert pool.num_used == 0
    pool.check_integrity()


def test_share_of_non_used_block_raises_without_side_effects() -> None:
    pool = BlockPool(4, 4)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockStateError):
        pool.share([a, 2])
    assert pool.refcount(a) == 1


# ---------------------------------------------------------------- prefix caching

def test_find_returns_longest_leading_run_and_counts_stats() -> None:
    pool = BlockPool(8, 4)
    hashes = prefix_block_hashes(list(range(16)), 4)
    ids = pool.allocate(4)
    for block_id, h in zip([ids[0], ids[1], ids[3]], [hashes[0], hashes[1], hashes[3]]):
        pool.register(block_id, h)
    assert pool.prefix.find_cached_prefix(hashes) == ids[:2]
    assert pool.prefix.find_cached_prefix(hashes[2:]) == []
    stats = pool.prefix.stats
    assert (stats.prefix_queries, stats.prefix_hits) == (6, 2)
    assert stats.hit_rate == pytest.approx(2 / 6)


def test_find_does_not_change_state() -> None:
    pool, ids, hashes = _filled_cached_pool(3)
    assert pool.prefix.find_cached_prefix(hashes) == ids
    assert pool.num_cached == 3 and all(pool.refcount(b) == 0 for b in ids)
    assert pool.allocate(1) == [ids[0]]


def test_acquire_revives_cached_and_shares_used() -> None:
    pool, ids, hashes = _filled_cached_pool(3)
    pool.acquire(pool.prefix.find_cached_prefix(hashes[:2]))
    assert [pool.refcount(b) for b in ids] == [1, 1, 0]
    assert pool.num_cached == 1 and pool.num_used == 2
    pool.acquire(pool.prefix.find_cached_prefix(hashes[:1]))
    assert pool.refcount(ids[0]) == 2
    pool.free(ids[:2])
    assert pool.refcount(ids[0]) == 1 and pool.block_state(ids[1]) is BlockState.CACHED
    pool.check_integrity()


def test_acquire_of_free_block_raises() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(BlockStateError):
        pool.acquire([0])
    assert pool.num_free == 2


def test_register_keeps_existing_mapping_on_duplicate_hash() -> None:
    pool = BlockPool(4, 4)
    first, second = pool.allocate(2)
    h = block_hash(None, [1, 2, 3, 4])
    assert pool.register(first, h)
    assert not pool.register(second, h)
    assert pool.prefix.hash_of(second) is None
    assert pool.prefix.find_cached_prefix([h]) == [first]
    pool.free([second])
    assert pool.block_state(second) is BlockState.FREE


def test_register_same_hash_twice_is_noop_but_different_hash_raises() -> None:
    pool = BlockPool(2, 4)
    (a,) = pool.allocate(1)
    assert pool.register(a, 11)
    assert not pool.register(a, 11)
    with pytest.raises(BlockStateError):
        pool.register(a, 12)
    assert pool.prefix.find_cached_prefix([11]) == [a]


def test_register_requires_used_block() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(BlockStateError):
        pool.register(0, 5)


def test_stats_snapshot_is_detached() -> None:
    pool = BlockPool(2, 4)
    pool.prefix.stats.evictions = 99
    assert pool.prefix.stats.evictions == 0


def test_disabled_prefix_caching() -> None:
    pool = BlockPool(2, 4, enable_prefix_caching=False)
    ids = pool.allocate(2)
    assert not pool.register(ids[0], 42)
    assert pool.prefix.find_cached_prefix([42]) == []
    pool.free(ids)
    assert (pool.num_free, pool.num_cached, pool.prefix.stats.prefix_queries) == (2, 0, 0)
    pool.check_integrity()


# ---------------------------------------------------------------- reservations

def test_reserve_commit_flow() -> None:
    pool = BlockPool(6, 4)
    ids = pool.reserve("req-1", 3, deadline=10.0)
    assert all(pool.block_state(b) is BlockState.RESERVED for b in ids)
    assert (pool.num_used, pool.num_available, pool.reservations.owners()) == (3, 3, ["req-1"])
    assert pool.commit_reservation("req-1") == ids
    assert all(pool.refcount(b) == 1 for b in ids)
    assert pool.reservations.owners() == [] and pool.num_used == 3
    pool.check_integrity()


def test_reserve_twice_for_same_owner_raises() -> None:
    pool = BlockPool(6, 4)
    pool.reserve("a", 1, 1.0)
    with pytest.raises(BlockStateError):
        pool.reserve("a", 1, 1.0)
    assert pool.num_used == 1


def test_reserve_beyond_capacity_raises_without_side_effects() -> None:
    pool = BlockPool(2, 4)
    with pytest.raises(NoFreeBlocksError):
        pool.reserve("a", 3, 1.0)
    assert pool.reservations.owners() == [] and pool.num_free == 2


def test_cancel_is_idempotent_and_frees_blocks() -> None:
    pool = BlockPool(4, 4)
    pool.reserve("a", 2, 1.0)
    assert pool.cancel_reservation("a")
    assert not pool.cancel_reservation("a")
    assert pool.num_free == 4
    with pytest.raises(BlockStateError):
        pool.commit_reservation("a")


def test_reserved_blocks_cannot_be_freed_shared_or_evicted() -> None:
    pool = BlockPool(3, 4)
    (r,) = pool.reserve("a", 1, 1.0)
    for operation in (pool.free, pool.share, pool.acquire):
        with pytest.raises(BlockStateError):
            operation([r])
    assert r not in pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_expire_cancels_only_reservations_past_deadline() -> None:
    pool = BlockPool(6, 4)
    pool.reserve("early", 2, 5.0)
    pool.reserve("late", 2, 20.0)
    assert pool.expire_reservations(4.9) == []
    assert pool.expire_reservations(5.0) == ["early"]
    assert pool.reservations.owners() == ["late"] and pool.num_free == 4
    pool.check_integrity()


# ---------------------------------------------------------------- integrity checker

def test_integrity_detects_corruption() -> None:
    pool = BlockPool(4, 4)
    (a,) = pool.allocate(1)
    pool.states._free[a] = None
    with pytest.raises(AssertionError, match="free list"):
        pool.check_integrity()


def test_integrity_detects_cached_block_without_hash() -> None:
    pool, ids, _ = _filled_cached_pool(2)
    del pool.prefix._hash_to_block[pool.prefix._block_to_key.pop(ids[0])]
    with pytest.raises(AssertionError, match="no hash"):
        pool.check_integrity()


# ---------------------------------------------------------------- stateful model check

HASH_UNIVERSE = [block_hash(None, [i]) for i in range(6)]
OWNERS = ["p0", "p1", "p2"]


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a pool with random operations and checks it against a simple reference model."""

    num_blocks = 8
    enable_prefix_caching = True
    num_groups = 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.num_blocks, 4, self.enable_prefix_caching, self.num_groups)
        self.held: Counter[int] = Counter()  # references the test holds, per block
        self.hash_of: dict[int, int] = {}  # model of which block holds which hash
        self.group_of: dict[int, int] = {}  # model of the group each held or cached block holds pages of
        self.cached_lru: list[int] = []  # model of CACHED blocks, least recently freed first
        self.reservations: dict[str, tuple[list[int], float]] = {}
        self.queries = self.hits = self.evictions = 0

    # -- model helpers

    def _reserved_ids(self) -> set[int]:
        return {b for ids, _ in self.reservations.values() for b in ids}

    def _model_free_count(self) -> int:
        return self.num_blocks - len(+self.held) - len(self._reserved_ids()) - len(self.cached_lru)

    def _take_from_model(self, taken: list[int]) -> None:
        """Check that taking blocks evicted exactly the LRU head, and update the model."""
        evict_count = max(0, len(taken) - self._model_free_count())
        assert taken[len(taken) - evict_count:] == self.cached_lru[:evict_count]
        assert not set(taken[:len(taken) - evict_count]) & set(self.cached_lru)
        self.cached_lru = self.cached_lru[evict_count:]
        self.evictions += evict_count
        for block_id in taken:
            assert self.held[block_id] == 0 and block_id not in self._reserved_ids()
            self.hash_of.pop(block_id, None)
            self.group_of.pop(block_id, None)

    def _hashes_in(self, group: int) -> dict[int, int]:
        """hash -> block, of the model's blocks of `group`."""
        return {h: b for b, h in self.hash_of.items() if self.group_of[b] == group}

    def _release_in_model(self, block_id: int) -> None:
        self.held[block_id] -= 1
        if self.held[block_id] == 0 and block_id in self.hash_of:
            self.cached_lru.append(block_id)
        elif self.held[block_id] == 0:
            del self.group_of[block_id]

    # -- rules

    @rule(n=st.integers(0, 5), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        group = data.draw(st.integers(0, self.num_groups - 1))
        if n > self.pool.num_available:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n, group)
            return
        taken = self.pool.allocate(n, group)
        assert len(set(taken)) == n
        self._take_from_model(taken)
        self.held.update(taken)
        self.group_of.update(dict.fromkeys(taken, group))

    @precondition(lambda self: +self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        refs = list((+self.held).elements())
        chosen = data.draw(st.lists(st.sampled_from(refs), max_size=len(refs)))
        chosen = [b for b, count in Counter(chosen).items() for _ in range(min(count, self.held[b]))]
        self.pool.free(chosen)
        for block_id in chosen:
            self._release_in_model(block_id)

    @precondition(lambda self: +self.held)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(sorted(+self.held)))
        self.pool.share([block_id])
        self.held[block_id] += 1

    @rule(block_id=st.integers(0, 7))
    def free_invalid_raises(self, block_id: int) -> None:
        if self.held[block_id] == 0:
            with pytest.raises(BlockStateError):
                self.pool.free([block_id])

    @precondition(lambda self: +self.held)
    @rule(data=st.data(), h=st.sampled_from(HASH_UNIVERSE))
    def register(self, data: st.DataObject, h: int) -> None:
        block_id = data.draw(st.sampled_from(sorted(+self.held)))
        current = self.hash_of.get(block_id)
        if self.enable_prefix_caching and current is not None and current != h:
            with pytest.raises(BlockStateError):
                self.pool.register(block_id, h)
            return
        expect_new = self.enable_prefix_caching and current is None \
            and h not in self._hashes_in(self.group_of[block_id])
        assert self.pool.register(block_id, h) == expect_new
        if expect_new:
            self.hash_of[block_id] = h

    @rule(data=st.data())
    def find_and_acquire(self, data: st.DataObject) -> None:
        group = data.draw(st.integers(0, self.num_groups - 1))
        block_by_hash = self._hashes_in(group)
        known = sorted(block_by_hash)
        leading = data.draw(st.lists(st.sampled_from(known), unique=True, max_size=3)) if known else []
        hashes = leading + data.draw(st.lists(st.sampled_from(HASH_UNIVERSE), max_size=2))
        expected: list[int] = []
        for h in hashes:
            if h not in block_by_hash:
                break
            expected.append(block_by_hash[h])
        found = self.pool.prefix.find_cached_prefix(hashes, group)
        assert found == (expected if self.enable_prefix_caching else [])
        assert self.pool.prefix.lookup(hashes, group) == [block_by_hash.get(h) if self.enable_prefix_caching else None
                                                   for h in hashes]
        if self.enable_prefix_caching and group == 0:
            self.queries += len(hashes)
            self.hits += len(found)
        self.pool.acquire(found, group)
        self.cached_lru = [b for b in self.cached_lru if b not in found]
        self.held.update(found)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 4), deadline=st.integers(0, 10))
    def reserve(self, owner: str, n: int, deadline: int) -> None:
        if owner in self.reservations:
            with pytest.raises(BlockStateError):
                self.pool.reserve(owner, n, deadline)
        elif n > self.pool.num_available:
            with pytest.raises(NoFreeBlocksError):
                self.pool.reserve(owner, n, deadline)
        else:
            taken = self.pool.reserve(owner, n, deadline)
            self._take_from_model(taken)
            self.reservations[owner] = (taken, deadline)

    @rule(owner=st.sampled_from(OWNERS))
    def commit(self, owner: str) -> None:
        if owner not in self.reservations:
            with pytest.raises(BlockStateError):
                self.pool.commit_reservation(owner)
            return
        ids, _ = self.reservations.pop(owner)
        assert self.pool.commit_reservation(owner) == ids
        self.held.update(ids)
        self.group_of.update(dict.fromkeys(ids, 0))

    @precondition(lambda self: self.num_groups > 1 and self.group_of)
    @rule(data=st.data())
    def acquire_into_another_group_raises(self, data: st.DataObject) -> None:
        """A block's pages belong to its group's layers: no other group may take it."""
        block_id = data.draw(st.sampled_from(sorted(self.group_of)))
        other = (self.group_of[block_id] + data.draw(st.integers(1, self.num_groups - 1))) % self.num_groups
        with pytest.raises(BlockStateError):
            self.pool.acquire([block_id], other)

    @rule(owner=st.sampled_from(OWNERS))
    def cancel(self, owner: str) -> None:
        assert self.pool.cancel_reservation(owner) == (owner in self.reservations)
        self.reservations.pop(owner, None)

    @rule(now=st.integers(0, 10))
    def expire(self, now: int) -> None:
        expected = {o for o, (_, deadline) in self.reservations.items() if deadline <= now}
        assert set(self.pool.expire_reservations(now)) == expected
        for owner in expected:
            del self.reservations[owner]

    # -- invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_integrity()

    @invariant()
    def pool_agrees_with_model(self) -> None:
        pool = self.pool
        assert pool.num_used == len(+self.held) + len(self._reserved_ids())
        assert pool.num_cached == len(self.cached_lru)
        assert pool.num_free == self._model_free_count()
        assert all(pool.refcount(b) == self.held[b] for b in range(self.num_blocks))
        assert all(pool.prefix.hash_of(b) == h for b, h in self.hash_of.items())
        assert set(pool.reservations.owners()) == set(self.reservations)
        assert all(pool.states.group_of(b) == self.group_of.get(b) for b in range(self.num_blocks))
        assert [pool.states.num_used_in(g) for g in range(self.num_groups)] == \
            [sum(1 for b in +self.held if self.group_of[b] == g) for g in range(self.num_groups)]
        stats = pool.prefix.stats
        assert (stats.prefix_queries, stats.prefix_hits, stats.evictions) == (self.queries, self.hits, self.evictions)


class BlockPoolWithoutPrefixCachingMachine(BlockPoolMachine):
    enable_prefix_caching = False


class GroupedBlockPoolMachine(BlockPoolMachine):
    """Three KV-cache groups (a full one and two windowed ones, as engine/kv/groups.py lays out Gemma): the
    same hashes registered in several groups name different blocks, and lookups never cross groups."""

    num_groups = 3


_MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = _MACHINE_SETTINGS
TestBlockPoolWithoutPrefixCachingStateful = BlockPoolWithoutPrefixCachingMachine.TestCase
TestBlockPoolWithoutPrefixCachingStateful.settings = _MACHINE_SETTINGS
TestGroupedBlockPoolStateful = GroupedBlockPoolMachine.TestCase
TestGroupedBlockPoolStateful.settings = _MACHINE_SETTINGS
