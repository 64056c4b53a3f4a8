"""What the tests leave in /tmp and /dev/shm: tests/conftest.py compares each module's before and after.

Counted: every new entry of /dev/shm, and every new entry of the temporary directory but those its owners keep by
design: pytest's own base directory (it prunes old runs itself), Ray's session logs and torch's compile cache.

Under pytest-xdist each worker has a temporary directory of its own (`use_worker_tmpdir`), but /dev/shm is shared:
there an entry named by a process of this project (transport/owned.py) counts only where its owner is this worker
or a process seen among its descendants (`Descendants`), so that one worker never blames, or removes, what
another's servers hold.
"""
from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Callable

from transport.owned import PREFIX, pid_namespace

SHM = Path("/dev/shm")
KEPT_BY_DESIGN = ("pytest-of-", "ray", "torchinductor_", "pip-")
OWNED = re.compile(rf"{re.escape(PREFIX)}-[a-z_]+-(\d+)-(\d+)-")  # any kind: its namespace and owner


def use_worker_tmpdir(worker: str | None) -> Path | None:
    """Under xdist (`worker`: gw0, gw1, ...), a temporary directory for this worker and every process it starts:
    the servers' socket directories and what a killed one leaves are then this worker's alone. Short, as it
    prefixes socket paths."""
    if not worker:
        return None
    path = Path(tempfile.gettempdir())
    if path.name != f"pt-{worker}":  # a pytest run by a test inherits its worker's directory
        path = path / f"pt-{worker}"
    path.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return path


def watched() -> tuple[Path, Path]:
    return Path(tempfile.gettempdir()), SHM


def entries() -> set[Path]:
    """The entries of the watched directories that a test could have left."""
    found = set()
    for directory in watched():
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found.update(directory / n for n in names if not n.startswith(KEPT_BY_DESIGN))
    return found


def left_since(before: set[Path], ours: Callable[[Path], bool] = lambda path: True) -> set[Path]:
    return {p for p in entries() - before if p.exists() and ours(p)}


class Descendants:
    """The pids of this process's descendants, sampled from /proc while it runs (a context manager), and
    `ours(path)`: whether a /dev/shm entry is this process's or theirs (an entry not named by this project
    counts as ours; one of another PID namespace does not)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="leak-descendants", daemon=True)

    def __enter__(self) -> Descendants:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        for pid, parent in _parents():
            children.setdefault(parent, []).append(pid)
        todo = [os.getpid()]
        while todo:
            for child in children.get(todo.pop(), ()):
                self.seen.add(child)
                todo.append(child)

    def ours(self, path: Path) -> bool:
        if path.parent != SHM:
            return True
        match = OWNED.match(path.name)
        if match is None:
            return True
        namespace, owner = int(match.group(1)), int(match.group(2))
        return namespace == pid_namespace() and (owner == os.getpid() or owner in self.seen)


def _parents() -> list[tuple[int, int]]:
    """(pid, parent pid) of every process /proc shows."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        found.append((int(name), int(stat.rsplit(")", 1)[1].split()[1])))
    return found
