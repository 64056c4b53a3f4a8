"""The leak check's own parts (tests/leaks.py): a worker's temporary directory, and which /dev/shm entries a
worker counts as its own when workers share /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import leaks
from transport.owned import owned_prefix, pid_namespace


def test_a_worker_gets_its_own_temporary_directory_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert leaks.use_worker_tmpdir(None) is None and tempfile.gettempdir() == str(tmp_path)
    mine = leaks.use_worker_tmpdir("gw1")
    assert mine == tmp_path / "pt-gw1" and mine.is_dir() and tempfile.gettempdir() == str(mine)
    assert leaks.use_worker_tmpdir("gw1") == mine  # a pytest that a test runs stays in it
    assert leaks.watched()[0] == mine


def test_shm_entries_count_as_ours_by_owner():
    seen = leaks.Descendants()
    seen.seen.add(424242)
    shm = leaks.SHM
    assert seen.ours(shm / f"{owned_prefix('kv')}decode-0")  # this process's own
    assert seen.ours(shm / f"{owned_prefix('kv', 424242)}decode-0")  # a descendant seen while it ran
    assert not seen.ours(shm / f"{owned_prefix('kv', 434343)}decode-0")  # another worker's
    assert not seen.ours(shm / f"phase-serve-kv-{pid_namespace() + 1}-424242-decode-0")  # another namespace's
    assert seen.ours(shm / "torch_123_0")  # not named by this project: counted
    assert seen.ours(Path(tempfile.gettempdir()) / f"{owned_prefix('actors', 434343)}x")  # the worker's own dir


@pytest.mark.process
def test_descendants_are_seen_while_they_run():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '1'])"])
    try:
        with leaks.Descendants(interval=0.05) as descendants:
            child.wait(30)
    finally:
        child.kill()
    assert child.pid in descendants.seen and os.getpid() not in descendants.seen
    assert len(descendants.seen) >= 2  # the grandchild (sleep) too
