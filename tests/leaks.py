"""What the tests leave in /tmp and /dev/shm: tests/conftest.py compares each module's before and after.

Counted: every new entry of /dev/shm, and every new entry of /tmp but those its owners keep by design: pytest's
own base directory (it prunes old runs itself), Ray's session logs and torch's compile cache."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

WATCHED = (Path(tempfile.gettempdir()), Path("/dev/shm"))
KEPT_BY_DESIGN = ("pytest-of-", "ray", "torchinductor_", "pip-")


def entries() -> set[Path]:
    """The entries of the watched directories that a test could have left."""
    found = set()
    for directory in WATCHED:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found.update(directory / n for n in names if not n.startswith(KEPT_BY_DESIGN))
    return found


def left_since(before: set[Path]) -> set[Path]:
    return {p for p in entries() - before if p.exists()}
