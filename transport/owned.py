"""Names for what this project creates outside its own tree (shared-memory segments, socket directories), and
reclaiming what a killed server left behind.

Each name carries the PID namespace and the pid of the process that owns it: `phase-serve-KIND-NS-PID-...`.
A later start removes an entry only when its name has that shape, its namespace is ours (with `--ipc=host`
/dev/shm is shared with other containers, whose pids mean nothing here), its owner is gone, and the entry
belongs to this user. A reused pid only keeps a stale entry a while longer; it never removes a live one.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger("transport")
PREFIX = "phase-serve"


def pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owned_prefix(kind: str, pid: int | None = None) -> str:
    """The start of a name owned by `pid` (default: this process); callers append something unique."""
    return f"{PREFIX}-{kind}-{pid_namespace()}-{os.getpid() if pid is None else pid}-"


def owner_of(name: str, kind: str) -> int | None:
    """The owning pid named in `name`, when it is ours in shape and PID namespace; else None."""
    match = re.fullmatch(rf"{re.escape(PREFIX)}-{re.escape(kind)}-(\d+)-(\d+)-.+", name)
    if match is None or int(match.group(1)) != pid_namespace():
        return None
    return int(match.group(2))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def owned_entries(directory: Path, kind: str) -> list[tuple[Path, int]]:
    """The entries of `kind` in `directory` named by a process of our PID namespace, with their owners."""
    try:
        entries = list(directory.glob(f"{PREFIX}-{kind}-*"))
    except OSError:
        return []
    owned = ((entry, owner_of(entry.name, kind)) for entry in entries)
    return [(entry, pid) for entry, pid in owned if pid is not None]


def reclaim(directory: Path, kind: str) -> list[Path]:
    """Remove the entries of `kind` in `directory` whose owner is gone; returns what was removed."""
    removed = []
    for entry, pid in owned_entries(directory, kind):
        if pid_alive(pid):
            continue
        try:
            if entry.lstat().st_uid != os.getuid():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:
            continue  # another starting server reclaimed it first
        except OSError as exc:
            log.warning("cannot remove %s left by pid %d: %s", entry, pid, exc)
            continue
        removed.append(entry)
    if removed:
        log.info("removed %d %s entries left in %s by processes that are gone", len(removed), kind, directory)
    return removed
