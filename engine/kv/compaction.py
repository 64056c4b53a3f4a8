"""Adaptive KV compression, the bookkeeping half (pure Python): which old pages go to the FP4 region.

When the hot pool cannot give a sequence the blocks it needs, the scheduler asks the compactor before it
preempts anyone. The compactor picks full, computed blocks that lie entirely before the newest
`keep_recent` tokens of running sequences, oldest positions first, takes a cold block for each, rewrites
the sequences' block tables in place and frees the hot blocks. It returns the moves (hot id, cold id); the
runner copies those pages into the FP4 region (engine/kv/compress.py) before the step's forward pass, so a
hot block freed here and handed to another sequence in the same step is overwritten only after its old
contents were compressed.

Sequences marked `compress_first` (long-in long-out requests, whose KV is largest and lives longest) give
up their old pages before anyone else's; the keep-recent window and all-or-nothing rule hold for them too.

Only blocks a sequence owns alone (refcount 1) move: a prefix block shared with other sequences would need
every owner's table rewritten and frees nothing until the last one lets go.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from engine.kv.block_pool import TieredBlockPool
from engine.core.sequence import Sequence

Move = tuple[int, int]  # (hot block id, cold block id)
MIN_BATCH_SHARE = 1 / 64  # of the hot blocks: the least an engine's compaction moves at once


@dataclass(frozen=True)
class _Candidate:
    position: int  # block index within its sequence: lower is older
    seq: Sequence


class Compactor:
    def __init__(self, pool: TieredBlockPool, keep_recent: int, min_batch: int = 1) -> None:
        """`min_batch`: blocks compressed at least per compaction, so that the per-layer kernel calls are shared
        by several pages instead of paid again at nearly every block boundary."""
        self.pool = pool
        self.keep_recent = keep_recent
        self.min_batch = max(1, min_batch)
        self.num_compressed_total = 0  # cumulative, for stats

    def make_room(self, needed: int, running: Iterable[Sequence]) -> list[Move]:
        """Compress old blocks until `needed` hot blocks can be allocated. All or nothing: when the candidates
        or the cold region cannot cover the shortfall, nothing changes (the caller preempts instead, and
        compressing pages then would cost accuracy without saving anyone)."""
        shortfall = needed - self.pool.num_available
        if shortfall <= 0:
            return []
        room = self.pool.cold.num_available
        candidates = self.candidates(running)
        if min(len(candidates), room) < shortfall:
            return []
        chosen = candidates[:min(max(shortfall, self.min_batch), len(candidates), room)]
        moves = self._move(chosen)
        self.num_compressed_total += len(moves)
        return moves

    def candidates(self, running: Iterable[Sequence]) -> list[_Candidate]:
        """Movable blocks: those of `compress_first` sequences before all others, then oldest position first;
        among equal positions, the lowest-priority sequence first (the one that would be preempted first)."""
        found = []
        for seq in sorted(running, key=lambda s: s.sort_key, reverse=True):
            for i in range(self.num_compressible(seq)):
                block_id = seq.block_ids[i]
                if not self.pool.is_cold(block_id) and self.pool.refcount(block_id) == 1:
                    found.append(_Candidate(i, seq))
        found.sort(key=lambda c: (not c.seq.compress_first, c.position))  # stable: keeps the priority order
        return found

    def num_compressible(self, seq: Sequence) -> int:
        """Leading blocks of `seq` that are full, computed and older than its newest keep_recent tokens."""
        limit = min(seq.num_computed_tokens, seq.num_tokens - self.keep_recent)
        return max(0, min(limit // self.pool.block_size, len(seq.block_ids)))

    def _move(self, chosen: list[_Candidate]) -> list[Move]:
        cold_ids = self.pool.allocate_cold(len(chosen))
        moves = []
        for cand, cold_id in zip(chosen, cold_ids):
            moves.append((cand.seq.block_ids[cand.position], cold_id))
            cand.seq.block_ids[cand.position] = cold_id
        # Newest positions first into the LRU, so a compressed prefix (still findable by hash) is evicted last.
        order = sorted(range(len(chosen)), key=lambda j: chosen[j].position, reverse=True)
        self.pool.free(moves[j][0] for j in order)
        return moves
