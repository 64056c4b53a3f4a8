"""Write-back of evicted blocks to the KV tiers, off the step thread.

The pool's eviction hook copies a block's pages into a buffer at once (the block is about to take new content)
and queues it here; one thread per engine publishes each queued block to every tier in turn (host, then disk).
Until it is published, a queued block is served from its buffer (`pending`), so a prompt that comes back at once
still finds it. The queue holds at most `max_bytes`; a block that would pass that is dropped and counted: the
tiers are a cache, and the step never waits for them.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class BlockSink(Protocol):
    """What the writer publishes to (engine/kv/tier_store.TierStore)."""

    name: str

    def write(self, block_hash: int, depth: int, payload: bytearray) -> bool: ...


@dataclass(frozen=True, eq=False)
class PendingBlock:
    """A block's pages, copied out of the pool, on their way to the tiers."""

    block_hash: int
    depth: int
    payload: bytearray


class TierWriter:
    """The queue and its thread. `on_stored(tier name, bytes)` hears each entry a tier took."""

    def __init__(self, sinks: list[BlockSink], max_bytes: int, on_stored: Callable[[str, int], None]) -> None:
        self.sinks = sinks
        self.max_bytes = max_bytes
        self.on_stored = on_stored
        self.pending: dict[int, PendingBlock] = {}  # block hash -> its newest queued copy
        self.dropped = 0  # blocks not queued: the queue was full
        self._queue: deque[PendingBlock | None] = deque()
        self._queued_bytes = 0
        self._closed = False
        self._busy = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def submit(self, block: PendingBlock, wait: float = 0.0) -> bool:
        """Queue a block for the tiers, waiting up to `wait` seconds for room; False (and counted) when the queue
        stays full, or is closed."""
        with self._busy:
            self._busy.wait_for(lambda: self._queued_bytes + len(block.payload) <= self.max_bytes, wait)
            if self._closed or self._queued_bytes + len(block.payload) > self.max_bytes:
                self.dropped += 1
                return False
            self._queue.append(block)
            self._queued_bytes += len(block.payload)
            self.pending[block.block_hash] = block
            self._busy.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued block is published (or dropped by its tiers); False on timeout."""
        with self._busy:
            return self._busy.wait_for(lambda: not self._queue or not self._thread.is_alive(), timeout)

    def close(self, timeout: float) -> None:
        """Publish what is queued (within `timeout` seconds), then stop the thread."""
        with self._busy:
            if not self._closed:
                self._closed = True
                self._queue.append(None)
                self._busy.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._busy:
                self._busy.wait_for(lambda: bool(self._queue))
                block = self._queue[0]
            if block is None:
                return
            self._publish(block)
            with self._busy:
                self._queue.popleft()
                self._queued_bytes -= len(block.payload)
                if self.pending.get(block.block_hash) is block:
                    del self.pending[block.block_hash]
                self._busy.notify_all()

    def _publish(self, block: PendingBlock) -> None:
        for sink in self.sinks:
            try:
                if sink.write(block.block_hash, block.depth, block.payload):
                    self.on_stored(sink.name, len(block.payload))
            except Exception:  # a tier that fails must not stop the others, nor this thread
                log.exception("KV %s tier failed to store a block", sink.name)
