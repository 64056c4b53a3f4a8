"""The host tier's directory: shared memory (/dev/shm) owned by one process, attached to by the others by path.

The owner (the server's main process for its actors, or an engine running on its own) creates
`/dev/shm/phase-serve-kvhost-NS-PID-<id>/` (names of transport.owned) and removes it when it closes, at exit at
the latest, so nothing of it outlives `serve`; the directory of a server killed before it could is reclaimed by
the next start, its owner's pid being gone. Actors attach by path and never remove it: an actor killed
mid-write leaves at most a temporary file, which the tier's next eviction scan removes (engine/kv/tier_store.py).
An actor on another host finds no such directory and owns one of its own.

Entries are files written with write(2), never mapped: a full /dev/shm fails a store (the tier lacks that
block), it never raises SIGBUS.
"""
from __future__ import annotations

import shutil
import uuid
import weakref
from pathlib import Path

from engine.kv.export import MIB, shm_dir, shm_free_bytes
from engine.kv.tier_store import TierError
from transport.owned import owned_prefix, reclaim

KIND = "kvhost"  # the owned-name kind of host tier directories (transport.owned)


class HostTierDir:
    """A host tier's directory; the owner's removes itself on close (or when collected, or at exit)."""

    def __init__(self, path: Path, owned: bool) -> None:
        self.path = path
        self.owned = owned
        self._remove = weakref.finalize(self, shutil.rmtree, str(path), True) if owned else None

    @staticmethod
    def create(capacity: int, assume_free: int | None = None) -> "HostTierDir":
        """A new directory owned by this process. TierError when shared memory cannot hold `capacity` bytes
        (`assume_free`: the free bytes to assume instead of what the file system reports)."""
        directory = shm_dir()
        reclaim(directory, KIND)  # what servers killed with SIGKILL left
        free = shm_free_bytes(directory) if assume_free is None else assume_free
        if capacity > free:
            raise TierError(f"--kv-host-size asks for {capacity / MIB:.0f} MiB but {directory} has "
                            f"{free / MIB:.0f} MiB free: lower it, or give the container more shared memory "
                            f"(docker run --shm-size, or --ipc=host)")
        path = directory / f"{owned_prefix(KIND)}{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        return HostTierDir(path, owned=True)

    @staticmethod
    def attach(path: str | None, capacity: int, assume_free: int | None = None) -> "HostTierDir":
        """The directory another process owns at `path`, or (none there: another host, or no owner) a new one
        owned by this process."""
        if path and Path(path).is_dir():
            return HostTierDir(Path(path), owned=False)
        return HostTierDir.create(capacity, assume_free)

    def close(self) -> None:
        """The owner removes the directory and every entry in it; an attached process leaves it."""
        if self._remove is not None:
            self._remove()

