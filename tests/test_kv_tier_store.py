"""engine/kv/tier_store.py, host_tier.py and tier_writer.py: entries published whole or not at all, every damaged or
foreign entry read as a miss, capacity kept by evicting the least recently used and deepest blocks, writers killed
mid-write or racing on the same blocks leaving a sound tier, and the host tier's directory owned and removed."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.kv import tier_store
from engine.kv.host_tier import KIND, HostTierDir
from engine.kv.tier_store import (HEADER_BYTES, NAMESPACE_BYTES, TEMP_PREFIX, TierError, TierStore, entry_name,
                                  stored_depth)
from engine.kv.tier_writer import PendingBlock, TierWriter
from tests.server_utils import wait_until
from transport.owned import owned_prefix

REPO = Path(__file__).resolve().parent.parent
NS = bytes(range(NAMESPACE_BYTES))
OTHER_NS = bytes(reversed(range(NAMESPACE_BYTES)))
SIZE = 4096  # payload bytes of one block
ENTRY = HEADER_BYTES + SIZE


class Clock:
    """Nanoseconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now

    def tick(self) -> None:
        self.now += 1_000_000


def payload(block_hash: int) -> bytes:
    return bytes((block_hash * 7 + i) % 251 for i in range(SIZE))


def store_at(directory: Path, capacity: int = 64 * ENTRY, namespace: bytes = NS, clock=None) -> TierStore:
    return TierStore("disk", directory, capacity, namespace, clock or Clock())


def read(store: TierStore, block_hash: int, depth: int) -> bytes | None:
    into = bytearray(SIZE)
    return bytes(into) if store.read(block_hash, depth, into) else None


def test_an_entry_comes_back_whole_and_is_counted(tmp_path):
    store = store_at(tmp_path)
    assert read(store, 11, 0) is None and store.bad_entries == 0  # absent: a plain miss
    assert store.write(11, 0, payload(11)) and store.contains(11, 0)
    assert read(store, 11, 0) == payload(11)
    assert not store.write(11, 0, payload(11))  # there already
    assert store.usage() == ENTRY
    assert sorted(os.listdir(tmp_path)) == [".lock", entry_name(NS, 11, 0)]  # no temporary left
    assert read(store, 11, 1) is None and read(store, 12, 0) is None  # another depth, another hash


@pytest.mark.parametrize("damage", ["truncate_payload", "truncate_header", "flip_payload", "flip_header", "append"])
def test_a_damaged_entry_is_a_counted_miss(tmp_path, damage):
    store = store_at(tmp_path)
    store.write(5, 3, payload(5))
    path = store.path(5, 3)
    data = bytearray(path.read_bytes())
    if damage == "truncate_payload":
        data = data[:-100]
    elif damage == "truncate_header":
        data = data[:HEADER_BYTES - 3]
    elif damage == "flip_payload":
        data[HEADER_BYTES + 1000] ^= 0x10
    elif damage == "flip_header":
        data[10] ^= 0x01
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    assert read(store, 5, 3) is None
    assert store.bad_entries == 1


def test_another_namespaces_entry_under_this_name_is_never_read(tmp_path):
    mine, theirs = store_at(tmp_path), store_at(tmp_path, namespace=OTHER_NS)
    theirs.write(9, 0, payload(9))
    assert read(mine, 9, 0) is None and not mine.contains(9, 0)
    os.replace(theirs.path(9, 0), mine.path(9, 0))  # their file where ours would be
    assert read(mine, 9, 0) is None and mine.bad_entries == 1


def test_eviction_takes_the_least_recently_used_then_the_deepest(tmp_path):
    clock = Clock()
    store = store_at(tmp_path, capacity=int(4.6 * ENTRY), clock=clock)  # a fifth entry makes room for itself
    for depth in range(3):  # one prompt's blocks stored at one time
        store.write(100 + depth, depth, payload(depth))
    clock.tick()
    store.write(200, 0, payload(200))
    clock.tick()
    read(store, 100, 0)  # the prompt's first block is used again: it is now the most recent
    clock.tick()
    store.write(300, 0, payload(300))  # full: frees down to 90% of the capacity less the new entry, one goes
    left = {(h, d) for h, d in [(100, 0), (101, 1), (102, 2), (200, 0), (300, 0)] if store.contains(h, d)}
    assert left == {(100, 0), (101, 1), (200, 0), (300, 0)}  # of the stalest, the deepest
    assert store.usage() == 4 * ENTRY


def test_a_block_larger_than_the_tier_or_a_full_file_system_is_not_stored(tmp_path, monkeypatch):
    assert not store_at(tmp_path / "tiny", capacity=ENTRY - 1).write(1, 0, payload(1))
    store = store_at(tmp_path / "full")

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_store.os, "write", no_space)
    assert not store.write(2, 0, payload(2)) and store.failed_writes == 1
    monkeypatch.undo()
    assert os.listdir(tmp_path / "full") == [".lock"] and store.usage() == 0
    assert store.write(2, 0, payload(2)) and read(store, 2, 0) == payload(2)  # room again: stored


def test_a_tier_reopened_counts_and_serves_what_it_held(tmp_path):
    first = store_at(tmp_path)
    for h in range(5):
        first.write(h, h, payload(h))
    first.close()
    again = store_at(tmp_path)
    assert again.usage() == 5 * ENTRY and read(again, 4, 4) == payload(4)
    assert stored_depth([tmp_path / "elsewhere", tmp_path], NS, [0, 1, 2, 9, 4]) == 3
    smaller = store_at(tmp_path, capacity=2 * ENTRY)  # reopened with less room: trimmed at once
    assert smaller.usage() <= 2 * ENTRY


def test_a_capacity_that_holds_no_entry_is_refused(tmp_path):
    with pytest.raises(TierError, match="holds no entry"):
        store_at(tmp_path, capacity=HEADER_BYTES)


KILLED_WRITER = """
import os, signal, sys
from engine.kv import tier_store
from engine.kv.tier_store import TierStore
from tests.test_kv_tier_store import NS, payload
store = TierStore("disk", sys.argv[1], 1 << 20, NS, lambda: 1)
real_write = os.write
def write_then_die(fd, data):
    real_write(fd, bytes(data)[:len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
tier_store.os.write = write_then_die
store.write(7, 0, payload(7))
"""


@pytest.mark.process
def test_a_writer_killed_mid_write_leaves_no_entry_and_its_file_is_reclaimed(tmp_path):
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == -9
    temps = [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)]
    assert len(temps) == 1  # its half-written file, never published
    store = store_at(tmp_path)  # opening scans: the dead writer's file goes
    assert not store.contains(7, 0) and read(store, 7, 0) is None and store.bad_entries == 0
    assert os.listdir(tmp_path) == [".lock"] and store.usage() == 0


RACING_WRITER = """
import sys
from engine.kv.tier_store import TierStore
from tests.test_kv_tier_store import ENTRY, NS, payload
store = TierStore("disk", sys.argv[1], 24 * ENTRY, NS, lambda: 1)
for round_ in range(3):
    for h in range(40):
        store.write(h, h, payload(h))
"""


@pytest.mark.process
def test_two_processes_storing_the_same_blocks_at_once_leave_a_sound_tier(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", RACING_WRITER, str(tmp_path)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    store = store_at(tmp_path, capacity=24 * ENTRY)
    entries = store.scan()
    assert entries and sum(e.size for e in entries) == store.usage() <= 24 * ENTRY
    for entry in entries:  # every published entry is whole
        depth = entry.depth
        assert read(store, depth, depth) == payload(depth)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)] and store.bad_entries == 0


def test_the_host_tier_directory_is_owned_by_its_maker_and_removed_on_close():
    owner = HostTierDir.create(1 << 20)
    assert owner.owned and owner.path.name.startswith(owned_prefix(KIND)) and owner.path.is_dir()
    attached = HostTierDir.attach(str(owner.path), 1 << 20)
    assert not attached.owned and attached.path == owner.path
    attached.close()
    assert owner.path.is_dir()  # an attached process leaves it
    store = TierStore("host", owner.path, 1 << 20, NS, Clock())
    store.write(1, 0, payload(1))
    owner.close()
    assert not owner.path.exists()
    store.close()
    elsewhere = HostTierDir.attach("/nonexistent/kvhost", 1 << 20)  # another host's path: a tier of our own
    assert elsewhere.owned and elsewhere.path.is_dir()
    elsewhere.close()
    assert not elsewhere.path.exists()


def test_a_host_tier_larger_than_shared_memory_is_refused():
    with pytest.raises(TierError, match="--kv-host-size asks for 64 MiB but .* has 8 MiB free"):
        HostTierDir.create(64 << 20, assume_free=8 << 20)


class SlowSink:
    """A tier that takes blocks only when the test lets it."""

    name = "host"

    def __init__(self) -> None:
        self.open = threading.Event()
        self.stored: list[int] = []

    def write(self, block_hash: int, depth: int, data: bytearray) -> bool:
        self.open.wait(30)
        self.stored.append(block_hash)
        return True


def test_the_writer_serves_queued_blocks_and_drops_what_does_not_fit():
    sink, stored = SlowSink(), []
    writer = TierWriter([sink], max_bytes=2 * SIZE, on_stored=lambda tier, n: stored.append((tier, n)))
    blocks = [PendingBlock(h, h, bytearray(payload(h))) for h in range(3)]
    assert writer.submit(blocks[0]) and writer.submit(blocks[1])
    assert not writer.submit(blocks[2]) and writer.dropped == 1  # the queue holds two blocks' bytes
    assert writer.pending[1] is blocks[1]  # queued: served from memory until published
    assert not writer.flush(timeout=0.05)
    sink.open.set()
    assert writer.flush(timeout=30)
    assert sink.stored == [0, 1] and stored == [("host", SIZE)] * 2 and not writer.pending
    writer.close(timeout=30)
    assert not writer.submit(blocks[2])  # closed
    assert wait_until(lambda: not writer._thread.is_alive(), 5)
