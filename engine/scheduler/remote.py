"""Blocks for prompts whose KV another actor writes (a prefill actor, over a hand-off): the cached prefix,
referenced at once, then fresh blocks reserved in the pool under a deadline. Committed when the KV arrives,
released when it will not (the peer died, the deadline passed, the request was aborted)."""
from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.prefix_index import prefix_block_hashes


class RemoteReservations:
    def __init__(self, pool: BlockPool, windows: tuple[int | None, ...]) -> None:
        self.pool = pool
        self.windows = windows
        self._held: dict[str, tuple[list[int], list[int]]] = {}  # request -> (cached blocks, their hashes)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def reserve(self, request_id: str, token_ids: list[int], deadline: float) -> tuple[list[int], int]:
        """(block table: the cached prefix then fresh blocks, number of prompt tokens already cached)."""
        if self.windows != (None,):
            raise ValueError("KV hand-off needs the plain KV layout: this engine gives windowed blocks back "
                             "(free_window_kv)")
        bs = self.pool.block_size
        hashes = prefix_block_hashes(token_ids[: len(token_ids) - 1], bs)
        cached = self.pool.prefix.find_cached_prefix(hashes)
        self.pool.acquire(cached)
        try:
            fresh = self.pool.reserve(request_id, -(-len(token_ids) // bs) - len(cached), deadline)
        except Exception:
            self.pool.free(reversed(cached))
            raise
        self._held[request_id] = (cached, hashes[: len(cached)])
        return cached + fresh, len(cached) * bs

    def fresh_blocks(self, request_id: str) -> list[int]:
        """The reserved (not cached) blocks a peer writes for this request."""
        return self.pool.reservations.blocks(request_id) if request_id in self._held else []

    def cancel(self, request_id: str) -> bool:
        cached, _ = self._held.pop(request_id, ([], []))
        self.pool.free(reversed(cached))
        return self.pool.cancel_reservation(request_id) or bool(cached)

    def expire(self, now: float) -> list[str]:
        expired = self.pool.expire_reservations(now)
        for rid in expired:
            self.cancel(rid)
        return expired

    def commit(self, request_id: str) -> tuple[list[int], list[int]]:
        """The KV has arrived: (the request's block table, the hashes of its cached prefix blocks)."""
        cached, hashes = self._held.pop(request_id)
        return cached + self.pool.commit_reservation(request_id), list(hashes)
