"""EngineStats: the one record of an engine's queues, KV pool and counters, under the same field names from the
engine to the heartbeat (transport.messages.EngineStats, converted by name in actors.convert), the router's
totals, /status and /metrics."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0  # draft tokens verified
    spec_accepted: int = 0  # ... of which accepted
    spec_steps: int = 0  # verifications (one sequence, one step, at least one draft)
    kv_bytes_per_token: float = 0.0  # KV pool bytes per cached token (smaller with --kv-cache-dtype fp8/fp4)
    kv_blocks_compressed: int = 0  # --kv-compress: FP4 blocks holding compressed pages now
    kv_blocks_cold_total: int = 0  # ... of this many in the FP4 region (not counted in kv_blocks_total)
    kv_compressions: int = 0  # pages compressed so far

    @staticmethod
    def total(parts: Iterable[EngineStats]) -> EngineStats:
        """Several engines as one: counts add up; bytes per token is the largest (a property, not a count)."""
        parts = list(parts)
        sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(EngineStats)}
        sums["kv_bytes_per_token"] = max((p.kv_bytes_per_token for p in parts), default=0.0)
        return EngineStats(**sums)
