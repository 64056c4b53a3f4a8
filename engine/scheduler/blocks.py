"""Each sequence's block tables in the pool: one table per KV-cache group, grown together. Full blocks are
registered in the prefix cache; a windowed group gives back the blocks no later query reads; a sequence starts
from the longest cached prefix that every group can serve, extended by the blocks that follow it in the KV
tiers (engine/kv/tiers.py: loaded into fresh blocks, registered, and counted as cached tokens)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.block_pool import BlockPool
from engine.kv.prefix_index import block_hash, prefix_block_hashes
from engine.kv.groups import NULL_BLOCK, first_needed_block
from engine.core.sequence import Sequence

if TYPE_CHECKING:
    from engine.kv.tiers import KVTiers


class SequenceBlocks:
    def __init__(self, pool: BlockPool, windows: tuple[int | None, ...], tiers: KVTiers | None = None) -> None:
        """`windows`: per KV-cache group, the window past which its blocks are given back (None: kept). `tiers`:
        the KV tiers below the pool (only with the plain layout: one group, nothing given back)."""
        if tiers is not None and windows != (None,):
            raise ValueError("the KV tiers need the plain KV layout: one group, no block given back")
        self.pool = pool
        self.windows = windows
        self.window = next((w for w in windows if w is not None), None)
        self.tiers = tiers

    def needed(self, seq: Sequence, num_new: int) -> int:
        """Pool blocks for `num_new` more tokens: as many per group (the tables grow together)."""
        total = seq.num_computed_tokens + num_new
        return len(self.windows) * max(0, -(-total // self.pool.block_size) - len(seq.block_ids))

    def grow(self, seq: Sequence, needed: int) -> None:
        """Extend every group's table by its share of `needed` blocks (which the pool can give)."""
        for group, table in enumerate(seq.block_tables):
            table.extend(self.pool.allocate(needed // len(self.windows), group))

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens (they held only rejected or never-filled drafts)."""
        keep = -(-seq.num_tokens // self.pool.block_size)
        for table in seq.block_tables:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(reversed(extra))

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the windowed groups' blocks that no query from num_computed_tokens on reads."""
        if self.window is None:
            return
        first = first_needed_block(seq.num_computed_tokens, self.window, self.pool.block_size)
        if first <= seq.released_blocks:
            return
        for table, window in zip(seq.block_tables, self.windows):
            if window is not None:
                released = table[seq.released_blocks:first]
                table[seq.released_blocks:first] = [NULL_BLOCK] * len(released)
                self.pool.free(reversed(released))
        seq.released_blocks = first

    def release(self, seq: Sequence) -> None:
        """All of the sequence's blocks back to the pool; it keeps its tokens (to be recomputed, or finished)."""
        for table in seq.block_tables:  # tail first, so the shared prefix is evicted last
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        seq.block_tables = [[] for _ in self.windows]
        seq.block_hashes, seq.num_computed_tokens, seq.released_blocks = [], 0, 0

    def register_full(self, seq: Sequence) -> None:
        """Hash the sequence's newly completed blocks and offer them to the prefix cache."""
        bs = self.pool.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))
            for table in seq.block_tables:
                if table[i] != NULL_BLOCK:
                    self.pool.register(table[i], seq.block_hashes[-1], i)

    def attach_cached_prefix(self, seq: Sequence) -> None:
        """Start `seq` from the longest cached prefix every group serves (its blocks acquired)."""
        # At least one token must run to produce logits, so the last token is never taken from the cache. A
        # prompt pass that reads every position (prompt logprobs, mean pooling) takes none of it: a cached prefix
        # kept its KV, not its hidden states.
        bs = self.pool.block_size
        recompute = seq.in_prompt_pass and seq.params.reads_every_prompt_position
        hashes = [] if recompute else prefix_block_hashes(seq.token_ids[: seq.num_tokens - 1], bs)
        found = [self.pool.prefix.lookup(hashes, group) for group in range(len(self.windows))]
        hit = self._cached_prefix_length(found, len(hashes))
        self.pool.prefix.record_prefix_query(len(hashes), hit)
        seq.released_blocks = 0 if self.window is None else first_needed_block(hit * bs, self.window, bs)
        seq.block_tables = [self._attach_group(seq, group, blocks[:hit]) for group, blocks in enumerate(found)]
        seq.block_hashes = hashes[:hit]
        if self.tiers is not None and hit < len(hashes):
            self._load_from_tiers(seq, hashes)
        seq.num_computed_tokens = len(seq.block_hashes) * bs
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _load_from_tiers(self, seq: Sequence, hashes: list[int]) -> None:
        """Extend the sequence's cached prefix with the blocks that follow it in the KV tiers: as many as the pool
        can take, loaded into fresh blocks and registered. Blocks not loaded (a bad entry, the deadline) go back."""
        start = len(seq.block_hashes)
        wanted = min(self.tiers.lookup(hashes[start:], start), self.pool.num_available)
        if wanted <= 0:
            return
        fresh = self.pool.allocate(wanted)
        loaded = self.tiers.load_run(hashes[start:start + wanted], start, fresh)
        self.pool.free(reversed(fresh[loaded:]))  # never written, never registered: FREE
        for i, block_id in enumerate(fresh[:loaded]):
            self.pool.register(block_id, hashes[start + i], start + i)
        seq.block_tables[0].extend(fresh[:loaded])
        seq.block_hashes.extend(hashes[start:start + loaded])

    def _cached_prefix_length(self, found: list[list[int | None]], longest: int) -> int:
        """The most leading blocks every group can serve (each group's lookups in `found`): each group in turn
        shortens the hit, until a whole round leaves it as it is (a windowed group's needs move with it)."""
        hit, previous = longest, None
        while hit != previous:
            previous = hit
            for blocks, window in zip(found, self.windows):  # a full group first, where there is one
                hit = self._group_hit(blocks, hit, window)
        return hit

    def _group_hit(self, blocks: list[int | None], longest: int, window: int | None) -> int:
        """The longest hit <= `longest` this group serves: every block before it (full), or those in the window
        of its first uncached position (windowed)."""
        if window is None:
            return blocks.index(None) if None in blocks[:longest] else longest
        bs = self.pool.block_size
        for hit in range(longest, 0, -1):
            if None not in blocks[first_needed_block(hit * bs, window, bs):hit]:
                return hit
        return 0

    def _attach_group(self, seq: Sequence, group: int, blocks: list[int | None]) -> list[int]:
        """Acquire the hit's blocks that `group` reads; the windowed ones it no longer needs stay NULL."""
        first = seq.released_blocks if self.windows[group] is not None else 0
        self.pool.acquire(blocks[first:], group)
        return [NULL_BLOCK] * first + blocks[first:]
