"""engine.disk_cache: entries keyed by a digest of their key, written atomically, read defensively (a bad entry is a
logged miss that the next put replaces), and sound when two processes fill the same entry at once."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import disk_cache
from engine.disk_cache import FORMAT, ROOT_ENV, DiskCache, cache_root, default_root, key_digest
from tests.server_utils import wait_until

REPO = Path(__file__).resolve().parent.parent
KEY = {"model": "/models/tiny.gguf", "threads": 4, "plan": [32, 128]}
VALUE = {"prefill": [[32, 0.01], [128, 0.04]], "decode": [[1, 0.002]]}


@pytest.fixture
def cache(tmp_path):
    return DiskCache(tmp_path / "root")


def _entry_files(cache: DiskCache, kind: str) -> list[str]:
    return sorted(os.listdir(cache.root / kind))


def test_a_json_value_comes_back_and_lives_under_its_kind(cache):
    assert cache.get_json("calibration", KEY) is None
    path = cache.put_json("calibration", KEY, VALUE)
    assert path == cache.path("calibration", KEY) and path.parent == cache.root / "calibration"
    assert cache.get_json("calibration", KEY) == VALUE
    assert cache.get_json("weights", KEY) is None  # another kind, another namespace


def test_bytes_come_back_and_keys_are_compared_whole(cache):
    payload = bytes(range(256)) * 40 + b"\n\x00tail"
    cache.put_bytes("weights", KEY, payload)
    assert cache.get_bytes("weights", dict(reversed(list(KEY.items())))) == payload  # key order is no part of it
    assert cache.get_bytes("weights", {**KEY, "threads": 8}) is None
    assert key_digest(KEY) != key_digest({**KEY, "threads": 8})


def test_a_second_put_replaces_the_entry(cache):
    cache.put_json("calibration", KEY, VALUE)
    cache.put_json("calibration", KEY, {"prefill": [], "decode": []})
    assert cache.get_json("calibration", KEY) == {"prefill": [], "decode": []}
    assert _entry_files(cache, "calibration") == [cache.path("calibration", KEY).name]  # no temporary left


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 7])  # a write that stopped part-way through the payload


def _header_only_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:data.index(b"\n") // 2])


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))


def _older_format(path: Path) -> None:
    header, _, payload = path.read_bytes().partition(b"\n")
    path.write_bytes(json.dumps(dict(json.loads(header), format=FORMAT - 1)).encode() + b"\n" + payload)


def _garbage_header(path: Path) -> None:
    path.write_bytes(b"\xff\xfe not json\n" + path.read_bytes())


@pytest.mark.parametrize("damage, problem", [(_truncate, "truncated"), (_header_only_half, "no header line"),
                                             (_flip_payload_byte, "does not match its digest"),
                                             (_older_format, f"format {FORMAT - 1}"),
                                             (_garbage_header, "header is not JSON")])
def test_a_damaged_entry_is_a_logged_miss_and_the_next_put_rebuilds_it(cache, caplog, damage, problem):
    path = cache.put_json("calibration", KEY, VALUE)
    damage(path)
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        assert cache.get_json("calibration", KEY) is None
    (record,) = caplog.records
    assert problem in record.getMessage() and str(path) in record.getMessage()
    cache.put_json("calibration", KEY, VALUE)
    assert cache.get_json("calibration", KEY) == VALUE


def test_another_keys_entry_at_this_path_is_a_miss(cache, caplog):
    other = {**KEY, "threads": 8}
    cache.put_json("calibration", other, VALUE)
    os.replace(cache.path("calibration", other), cache.path("calibration", KEY))  # as a digest collision would
    with caplog.at_level(logging.WARNING, logger=disk_cache.__name__):
        assert cache.get_json("calibration", KEY) is None
    assert "different kind or key" in caplog.text


def test_a_write_that_fails_leaves_the_old_entry_and_no_temporary(cache, monkeypatch):
    cache.put_json("calibration", KEY, VALUE)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_cache.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cache.put_json("calibration", KEY, {"prefill": [], "decode": []})
    assert cache.get_json("calibration", KEY) == VALUE
    assert _entry_files(cache, "calibration") == [cache.path("calibration", KEY).name]


def test_a_temporary_left_by_a_killed_writer_is_never_read(cache):
    path = cache.path("calibration", KEY)
    path.parent.mkdir(parents=True)
    (path.parent / f"{disk_cache.TEMP_PREFIX}abc{disk_cache.SUFFIX}").write_bytes(b'{"format": 1')
    assert cache.get_json("calibration", KEY) is None
    cache.put_json("calibration", KEY, VALUE)
    assert cache.get_json("calibration", KEY) == VALUE


def test_bad_kinds_keys_and_values_are_refused_by_name(cache):
    with pytest.raises(ValueError, match="cache kind .* got '../up'"):
        cache.path("../up", KEY)
    with pytest.raises(TypeError, match="not plain JSON"):
        cache.put_json("calibration", {"path": Path("/x")}, VALUE)
    with pytest.raises(TypeError, match="must be a dict"):
        cache.get_json("calibration", ["not", "a", "dict"])
    with pytest.raises(TypeError, match="calibration.*not plain JSON"):
        cache.put_json("calibration", KEY, {"seconds": float("nan")})


def test_the_default_root_follows_the_environment(tmp_path, monkeypatch):
    assert default_root({ROOT_ENV: str(tmp_path / "own")}) == tmp_path / "own"
    assert default_root({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "phase-serve"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_root({}) == tmp_path / "home" / ".cache" / "phase-serve"
    assert default_root({ROOT_ENV: "", "XDG_CACHE_HOME": ""}) == tmp_path / "home" / ".cache" / "phase-serve"


def test_the_flag_wins_over_the_default_and_tests_never_use_the_users_cache(tmp_path):
    assert cache_root(str(tmp_path / "flag")) == tmp_path / "flag"
    assert cache_root(None) == Path(os.environ[ROOT_ENV])  # tests/conftest.py: a directory of this test run
    assert Path.home() / ".cache" not in cache_root(None).parents


# Each process says it is ready and waits for the go file. Each writer then puts its own payload into the same
# entry again and again; the reader reads that entry until both writers are done (and once more) and reports
# what it saw.
_WRITER = """
import os, sys, time
from engine.disk_cache import DiskCache
root, go, tag, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cache = DiskCache(root)
payload = tag.encode() * (256 * 1024)
open(go + "." + tag, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
for _ in range(rounds):
    cache.put_bytes("weights", {"shared": True}, payload)
"""
_READER = """
import json, os, sys, tempfile, time
from engine.disk_cache import DiskCache
root, go, done = sys.argv[1], sys.argv[2], sys.argv[3]
key = {"shared": True}
whole = {}  # the complete entry file of each writer's payload, made in a root of the reader's own
for tag in ("a", "b"):
    whole[DiskCache(tempfile.mkdtemp(dir=os.path.dirname(go))).put_bytes("weights", key,
                                                                        tag.encode() * (256 * 1024)).read_bytes()] = tag
path = DiskCache(root).path("weights", key)
seen = {"none": 0, "a": 0, "b": 0, "other": 0}
open(go + ".reader", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
finished = False
while not finished:
    finished = os.path.exists(done)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = None
    seen["none" if data is None else whole.get(data, "other")] += 1
print(json.dumps(seen))
"""


@pytest.mark.process
def test_two_processes_filling_one_entry_leave_one_whole_entry_and_no_reader_sees_a_part(tmp_path):
    root, go, done = tmp_path / "root", tmp_path / "go", tmp_path / "done"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(go), tag, "40"], env=env, cwd=REPO)
               for tag in ("a", "b")]
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(root), str(go), str(done)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    ready = [Path(f"{go}.{name}") for name in ("a", "b", "reader")]
    assert wait_until(lambda: all(p.exists() for p in ready), 120), "the writers and the reader did not start"
    go.touch()
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    done.touch()
    out, _ = reader.communicate(timeout=60)
    seen = json.loads(out)
    assert reader.returncode == 0 and seen["other"] == 0, seen  # never a partial or mixed entry file
    assert seen["a"] + seen["b"] > 0
    final = DiskCache(root).get_bytes("weights", {"shared": True})
    assert final in (b"a" * 262144, b"b" * 262144)
    assert os.listdir(root / "weights") == [DiskCache(root).path("weights", {"shared": True}).name]


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """A temp file untouched for longer than STALE_TEMP_SECONDS goes at the next write into its directory; one a
    live writer is filling (recently touched) stays."""
    cache = DiskCache(tmp_path)
    entry = cache.put_json("calibration", {"a": 1}, [1])
    stale = entry.parent / f"{disk_cache.TEMP_PREFIX}killed{disk_cache.SUFFIX}"
    live = entry.parent / f"{disk_cache.TEMP_PREFIX}live{disk_cache.SUFFIX}"
    stale.write_bytes(b"half an entry")
    live.write_bytes(b"being written")
    old = live.stat().st_mtime - disk_cache.STALE_TEMP_SECONDS - 1
    os.utime(stale, (old, old))
    cache.put_json("calibration", {"a": 2}, [2])
    assert not stale.exists() and live.exists()
    assert cache.get_json("calibration", {"a": 1}) == [1] and cache.get_json("calibration", {"a": 2}) == [2]
