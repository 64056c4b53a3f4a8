"""An on-disk cache of what the engine derives from a model on one machine (start-up calibration, and the
kind of artefact that is slow to make and cheap to keep), so that a second start reuses the first one's work.

An entry is one file, `<root>/<kind>/<digest>.entry`: the digest is that of its key, a JSON-serialisable
dict that names everything the value depends on. The file is a JSON header line (format version, kind, key,
payload length and SHA-256) followed by the payload: raw bytes, or a JSON value's UTF-8 text. No pickle: a
cache file can at worst hold wrong data, never run code.

Writes go to a temporary file in the entry's own directory, which then replaces the entry (`os.replace`,
atomic within one file system): a reader sees the old entry, the new one or none, never part of one, and two
processes that fill the same entry at once leave one of their complete entries. Reads check the header
against the key and the payload against its length and digest: a corrupt, truncated, foreign or
older-format entry is logged and read as a miss, and the caller's next `put` replaces it. A temporary file a
killed writer left is deleted by a later write into its directory once untouched for STALE_TEMP_SECONDS.

The root: `--cache-dir`, else $PHASE_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/phase-serve, else
~/.cache/phase-serve. Standard library only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

log = logging.getLogger(__name__)

FORMAT = 1  # of an entry file; an entry of another format is a miss
ROOT_ENV = "PHASE_SERVE_CACHE_DIR"
APP_DIR = "phase-serve"
KIND = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
SUFFIX = ".entry"
TEMP_PREFIX = ".tmp-"
# A temporary file untouched this long is a killed writer's (a live one writes to it, refreshing its mtime)
STALE_TEMP_SECONDS = 3600.0
MAX_HEADER_BYTES = 1 << 20  # a key is a few fields; a longer first line is no header of ours


def default_root(env: Mapping[str, str] = os.environ) -> Path:
    """$PHASE_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/phase-serve, else ~/.cache/phase-serve."""
    if env.get(ROOT_ENV):
        return Path(env[ROOT_ENV]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / APP_DIR


def cache_root(configured: str | os.PathLike | None) -> Path:
    """The root a `--cache-dir` value names (None: the default root)."""
    return Path(configured).expanduser() if configured else default_root()


def key_digest(key: dict[str, Any]) -> str:
    """The hex SHA-256 of the key's canonical JSON (sorted keys, no spaces). TypeError names a value JSON
    cannot hold."""
    return hashlib.sha256(_canonical(key)).hexdigest()


def _canonical(key: dict[str, Any]) -> bytes:
    if not isinstance(key, dict):
        raise TypeError(f"a cache key must be a dict, got {type(key).__name__}")
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cache key {key!r} is not plain JSON ({exc})") from None


class DiskCache:
    """Entries under one root, each in a `kind` namespace (a short lower-case name such as "calibration")."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        """Where the entry of (kind, key) lives, whether or not it exists."""
        if not isinstance(kind, str) or not KIND.fullmatch(kind):
            raise ValueError(f"cache kind must be a short lower-case name ({KIND.pattern}), got {kind!r}")
        return self.root / kind / (key_digest(key)[:32] + SUFFIX)

    def get_bytes(self, kind: str, key: dict[str, Any]) -> bytes | None:
        """The payload stored for (kind, key); None for a miss, and for an entry that fails its checks."""
        path = self.path(kind, key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cache entry %s could not be read (%s); treated as a miss", path, exc)
            return None
        payload, problem = _parse(data, kind, key)
        if problem:
            log.warning("cache entry %s is %s; treated as a miss and rebuilt", path, problem,
                        extra={"cache_entry": str(path), "problem": problem})
        return payload

    def put_bytes(self, kind: str, key: dict[str, Any], payload: bytes) -> Path:
        """Stores the payload for (kind, key), replacing any entry, atomically; returns the entry's path.
        Raises OSError when the root cannot be written."""
        path = self.path(kind, key)
        header = {"format": FORMAT, "kind": kind, "key": key, "length": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest()}
        _write_atomically(path, _canonical(header) + b"\n" + payload)
        return path

    def get_json(self, kind: str, key: dict[str, Any]) -> Any | None:
        """The JSON value stored for (kind, key); None for a miss or a bad entry."""
        payload = self.get_bytes(kind, key)
        if payload is None:
            return None
        try:
            return json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # a digest that matches makes this rare
            log.warning("cache entry %s holds no JSON value (%s); treated as a miss", self.path(kind, key), exc)
            return None

    def put_json(self, kind: str, key: dict[str, Any], value: Any) -> Path:
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cache value of kind {kind!r} is not plain JSON ({exc})") from None
        return self.put_bytes(kind, key, text.encode())


def _parse(data: bytes, kind: str, key: dict[str, Any]) -> tuple[bytes | None, str]:
    """(payload, "") for a sound entry of (kind, key); (None, what is wrong) otherwise."""
    line_end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    if line_end < 0:
        return None, "truncated or not an entry (no header line)"
    try:
        header = json.loads(data[:line_end])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, "corrupt (its header is not JSON)"
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        return None, f"of format {found!r}, not {FORMAT}"
    if header.get("kind") != kind or header.get("key") != json.loads(_canonical(key)):
        return None, "another key's (its header names a different kind or key)"
    payload = data[line_end + 1:]
    if len(payload) != header.get("length"):
        return None, f"truncated ({len(payload)} of {header.get('length')} payload bytes)"
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return None, "corrupt (its payload does not match its digest)"
    return payload, ""


def _write_atomically(path: Path, data: bytes) -> None:
    """The whole of `data` at `path`, or nothing new there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)
    replace_file(path, lambda out: out.write(data), TEMP_PREFIX, SUFFIX)


def replace_file(path: Path, fill: Callable[[BinaryIO], object], prefix: str, suffix: str) -> None:
    """`fill(file)` writes a temporary file beside `path` (named prefix...suffix), which is synced and renamed over
    it: the whole of it at `path`, or nothing new there. The temporary file is removed on any error."""
    fd, temp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
            out.truncate()
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def remove_stale_temps(directory: Path, now: float | None = None) -> int:
    """Deletes the temporary files in `directory` that no writer has touched for STALE_TEMP_SECONDS (left by a
    process killed mid-write); returns how many. Another process removing one first is no error."""
    now = time.time() if now is None else now
    removed = 0
    for temp in directory.glob(f"{TEMP_PREFIX}*{SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if now - temp.stat().st_mtime > STALE_TEMP_SECONDS:
                temp.unlink()
                removed += 1
    return removed
