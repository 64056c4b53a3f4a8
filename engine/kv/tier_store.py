"""One tier of KV blocks below the pool: a directory of entry files that every process opening it shares.

The host tier is such a directory in /dev/shm (memory; engine/kv/host_tier.py makes it), the disk tier one on
disk (--kv-disk-dir). The same code serves both; it knows nothing of tensors, only of payload bytes.

Entries. One file per block, `<depth>-<key>.kv`: `depth` is the block's index in its prompt (0 = the first
block), `key` a digest of the store's namespace (model, weights, KV format, layout: engine/kv/tiers.py) and the
block's hash from the prefix cache's chain, which already covers every token before it. The file is a fixed
header (magic, format, namespace, block hash, depth, payload length, the payload's CRC-32, the header's own
CRC-32) and the payload: the block's pages in every layer. A read checks all of it against what the reader
expected, so a missing, truncated, corrupt or foreign entry is a miss (counted in `bad_entries` unless simply
absent), never wrong text.

Publishing. A writer fills a temporary file `.tmp-<pid>-<random>.kv` in the directory and, holding the
directory's lock, renames it to the entry's name: a reader sees a whole entry or none, never a block still being
written. Two processes storing the same block both write; the first rename wins and the second drops its file.
A temporary file whose writer is gone (killed mid-write) is removed by the next eviction scan or opening.

Capacity and eviction. The lock file (`.lock`, an flock) also holds the ledger: the bytes of every published
entry, updated under the lock with each publish. A publish that would pass the capacity first evicts, under the
lock, from a scan of the directory (which also corrects the ledger): least recently used first, where a read
refreshes an entry's time; among entries of the same time, the deepest first, since a block is useless once any
block before it is gone (and a prompt's blocks are read, hence refreshed, together). Eviction frees down to
LOW_WATER of the capacity, so scans are rare. Readers take no lock: an entry unlinked while open stays readable.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.config import ConfigError
from transport.owned import pid_alive

log = logging.getLogger(__name__)

MAGIC = b"PSKV"
FORMAT = 1  # of an entry file; an entry of another format is a miss
HEADER = struct.Struct("<4sHH32sQIQI")  # magic, format, reserved, namespace, block hash, depth, length, payload crc
HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = HEADER.size + HEADER_CRC.size
LEDGER = struct.Struct("<Q")
SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
LOW_WATER = 0.9  # an eviction frees down to this share of the capacity
NAMESPACE_BYTES = 32


class TierError(ConfigError):
    """A tier cannot be opened as configured (its directory, its capacity)."""


@dataclass(frozen=True)
class StoredEntry:
    """An entry as an eviction scan sees it."""

    path: Path
    depth: int
    size: int
    mtime_ns: int


def entry_key(namespace: bytes, block_hash: int) -> str:
    """The hex digest naming a block's entry: its namespace and its place in the prefix hash chain."""
    return hashlib.blake2b(namespace + struct.pack("<Q", block_hash), digest_size=16).hexdigest()


def entry_name(namespace: bytes, block_hash: int, depth: int) -> str:
    """The file name of a block's entry in any tier's directory."""
    return f"{depth:05d}-{entry_key(namespace, block_hash)}{SUFFIX}"


def stored_depth(directories: list[Path], namespace: bytes, hashes: list[int]) -> int:
    """How many leading blocks of a prompt (its chain of block hashes) any of the tier directories holds; a
    look at file names only, for a process that keeps no store open (the router's placement)."""
    for depth, block_hash in enumerate(hashes):
        name = entry_name(namespace, block_hash, depth)
        if not any((directory / name).exists() for directory in directories):
            return depth
    return len(hashes)


def encode_header(namespace: bytes, block_hash: int, depth: int, payload: bytes | bytearray | memoryview) -> bytes:
    header = HEADER.pack(MAGIC, FORMAT, 0, namespace, block_hash, depth, len(payload), zlib.crc32(payload))
    return header + HEADER_CRC.pack(zlib.crc32(header))


def check_header(data: bytes, namespace: bytes, block_hash: int, depth: int, length: int) -> str:
    """"" for the header of exactly this entry; else what is wrong with it."""
    if len(data) < HEADER_BYTES:
        return "truncated (no whole header)"
    header = data[:HEADER.size]
    if HEADER_CRC.unpack_from(data, HEADER.size)[0] != zlib.crc32(header):
        return "corrupt (its header fails its checksum)"
    magic, version, _, found_ns, found_hash, found_depth, found_length, _ = HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT:
        return f"of format {version}, not {FORMAT}"
    if found_ns != namespace:
        return "another model's or KV format's (its namespace differs)"
    if (found_hash, found_depth, found_length) != (block_hash, depth, length):
        return "another block's (its hash, depth or length differs)"
    return ""


class TierStore:
    """Entries of one namespace in one directory of at most `capacity` bytes (shared with other processes and
    namespaces). `clock` gives nanoseconds for recency (time.time_ns; a test passes its own)."""

    def __init__(self, name: str, directory: str | os.PathLike, capacity: int, namespace: bytes,
                 clock: Callable[[], int]) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"a tier namespace is {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        if capacity <= HEADER_BYTES:
            raise TierError(f"the {name} tier's capacity of {capacity} bytes holds no entry")
        self.name = name
        self.directory = Path(directory)
        self.capacity = capacity
        self.namespace = namespace
        self.clock = clock
        self.bad_entries = 0  # entries found damaged or foreign, read as misses
        self.failed_writes = 0  # entries not stored: the file system full or failing
        self._lock_fd = self._open_lock()
        with self._locked():
            self._write_ledger(self._evict_to(capacity))  # counts what a previous run left, within capacity

    # ---------------------------------------------------------------- reading

    def path(self, block_hash: int, depth: int) -> Path:
        return self.directory / entry_name(self.namespace, block_hash, depth)

    def contains(self, block_hash: int, depth: int) -> bool:
        return self.path(block_hash, depth).exists()

    def read(self, block_hash: int, depth: int, into: bytearray) -> bool:
        """Fill `into` (exactly the payload's size) with the entry's payload and refresh its recency; False for a
        miss, including an entry that fails any check (then `into` holds garbage and must not be used)."""
        path = self.path(block_hash, depth)
        try:
            with open(path, "rb", buffering=0) as handle:
                problem = self._read_checked(handle, block_hash, depth, into)
        except FileNotFoundError:
            return False
        except OSError as exc:
            problem = f"unreadable ({exc})"
        if problem:
            self.bad_entries += 1
            log.warning("KV %s tier entry %s is %s; read as a miss", self.name, path.name, problem,
                        extra={"kv_tier": self.name, "entry": path.name, "problem": problem})
            return False
        self._touch(path)
        return True

    def _read_checked(self, handle, block_hash: int, depth: int, into: bytearray) -> str:
        header = handle.read(HEADER_BYTES)
        problem = check_header(header, self.namespace, block_hash, depth, len(into))
        if problem:
            return problem
        got = handle.readinto(into)
        if got != len(into) or handle.read(1):
            return f"truncated or overlong ({got} of {len(into)} payload bytes)"
        if zlib.crc32(into) != HEADER.unpack_from(header)[7]:
            return "corrupt (its payload fails its checksum)"
        return ""

    def _touch(self, path: Path) -> None:
        now = self.clock()
        with contextlib.suppress(OSError):  # evicted meanwhile: nothing to refresh
            os.utime(path, ns=(now, now))

    def usage(self) -> int:
        """Bytes of the published entries (every namespace), as the ledger says."""
        return LEDGER.unpack(os.pread(self._lock_fd, LEDGER.size, 0).ljust(LEDGER.size, b"\0"))[0]

    # ---------------------------------------------------------------- writing

    def write(self, block_hash: int, depth: int, payload: bytes | bytearray | memoryview) -> bool:
        """Publish the entry unless it is there already; False when it was, or when it cannot be stored (larger
        than the tier, the file system full or failing: the tier simply lacks it)."""
        path = self.path(block_hash, depth)
        size = HEADER_BYTES + len(payload)
        if size > self.capacity:
            return False
        if path.exists():
            self._touch(path)
            return False
        temp = self.directory / f"{TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}{SUFFIX}"
        try:
            self._write_temp(temp, encode_header(self.namespace, block_hash, depth, payload), payload)
            return self._publish(temp, path, size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink()
            self.failed_writes += 1
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or self.failed_writes == 1:
                log.warning("KV %s tier cannot store a block (%s); it goes without", self.name, exc)
            return False

    def _write_temp(self, temp: Path, header: bytes, payload: bytes | bytearray | memoryview) -> None:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for part in (header, payload):
                view = memoryview(part).cast("B")
                while view:  # a short write goes on where it stopped
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        now = self.clock()
        os.utime(temp, ns=(now, now))

    def _publish(self, temp: Path, path: Path, size: int) -> bool:
        with self._locked():
            if path.exists():  # another process stored the same block first
                temp.unlink()
                return False
            total = self.usage()
            if total + size > self.capacity:
                total = self._evict_to(int(self.capacity * LOW_WATER) - size)
            os.rename(temp, path)
            self._write_ledger(total + size)
        return True

    # ---------------------------------------------------------------- eviction

    def scan(self) -> list[StoredEntry]:
        """Every published entry of the directory (all namespaces), in eviction order; removes the temporary
        files of writers that are gone."""
        entries = []
        for item in os.scandir(self.directory):
            if item.name.startswith(TEMP_PREFIX):
                self._reclaim_temp(item)
            elif item.name.endswith(SUFFIX) and (depth := item.name.partition("-")[0]).isdigit():
                with contextlib.suppress(FileNotFoundError):
                    st = item.stat()
                    entries.append(StoredEntry(Path(item.path), int(depth), st.st_size, st.st_mtime_ns))
        return sorted(entries, key=lambda e: (e.mtime_ns, -e.depth))

    def _evict_to(self, target: int) -> int:
        """Unlink entries in eviction order until at most `target` bytes stay; returns the bytes that stay.
        Call with the lock held."""
        entries = self.scan()
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()
            total -= entry.size
        return total

    @staticmethod
    def _reclaim_temp(item: os.DirEntry) -> None:
        pid = item.name[len(TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(item.path)

    # ---------------------------------------------------------------- the lock and its ledger

    def _open_lock(self) -> int:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(f"the {self.name} tier cannot use {self.directory}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write_ledger(self, total: int) -> None:
        os.pwrite(self._lock_fd, LEDGER.pack(max(total, 0)), 0)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
