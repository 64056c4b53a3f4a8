"""Blocks held for requests whose KV another process writes: per owner, the block ids and a deadline.

Bookkeeping only: the pool (engine/kv/block_pool.py) takes the blocks and changes their state.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_states import BlockStateError


@dataclass
class _Reservation:
    block_ids: list[int]
    deadline: float


class Reservations:
    """One reservation per owner; `num_reserved` counts their blocks."""

    def __init__(self) -> None:
        self._by_owner: dict[str, _Reservation] = {}
        self.num_reserved = 0

    def __contains__(self, owner: str) -> bool:
        return owner in self._by_owner

    def add(self, owner: str, block_ids: list[int], deadline: float) -> None:
        if owner in self._by_owner:
            raise BlockStateError(f"owner {owner!r} already holds a reservation")
        self._by_owner[owner] = _Reservation(list(block_ids), deadline)
        self.num_reserved += len(block_ids)

    def pop(self, owner: str) -> list[int]:
        """The owner's blocks, forgetting the reservation; BlockStateError if it holds none."""
        if owner not in self._by_owner:
            raise BlockStateError(f"owner {owner!r} holds no reservation")
        reservation = self._by_owner.pop(owner)
        self.num_reserved -= len(reservation.block_ids)
        return reservation.block_ids

    def expired(self, now: float) -> list[str]:
        """Owners whose deadline is <= `now`."""
        return [owner for owner, res in self._by_owner.items() if res.deadline <= now]

    def blocks(self, owner: str) -> list[int]:
        reservation = self._by_owner.get(owner)
        return [] if reservation is None else list(reservation.block_ids)

    def owners(self) -> list[str]:
        return list(self._by_owner)

    def reserved_ids(self) -> list[int]:
        """Every reserved block id; AssertionError if the counter disagrees (the integrity check's view)."""
        reserved = [b for res in self._by_owner.values() for b in res.block_ids]
        if len(reserved) != self.num_reserved:
            raise AssertionError(f"reserved counter {self.num_reserved} != {len(reserved)} reserved ids")
        return reserved
