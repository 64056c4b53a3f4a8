"""Weights converted to the kernels' layout, kept on disk so that a later start maps them instead of converting.

An entry is two files under `<cache root>/weights/`, named by the digest of its key (engine/disk_cache.py
key_digest): `<digest>.data`, every tensor's bytes at 64-byte-aligned offsets, and `<digest>.index`, a JSON
object naming the key, the data file's size, the SHA-256 of its first and last MiB, and each tensor's offset,
dtype and shape (or the name of the tensor it shares its bytes with). A reader maps the data file privately
(copy on write: pages come from the page cache, and a write, which the engine never makes, stays in the process)
and hands out views of it. No pickle: an entry can at worst hold wrong numbers, never run code.

The key (`weight_key`) names everything the bytes depend on: the checkpoint's identity (engine/model/identity.py),
the serving dtype and the weight formats chosen, the backend's description (its kernel build key, dispatch table
and the packing it implies), the torch version, and a digest of the sources that convert and pack (SOURCES).

Filling: under an exclusive lock on `<digest>.lock` (a second process that wants the same entry waits, then
finds it filled), the index goes first (with any temporary file a killed writer of this entry left), then the
data file is written beside its place and renamed over it, then the index likewise: a reader sees a complete
entry or none. An entry whose data file is missing, of another
size, or whose first or last MiB does not match its index (a killed writer, a damaged disk, a hand edit) is a
miss, logged, and the next fill replaces it. A fill also removes the entries of the same checkpoint path and
options that no start can hit any more (`prune_stale`: the file rewritten, the sources or torch changed), so
that the directory does not grow by a model's size with every such change.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch

from engine.disk_cache import key_digest, replace_file

log = logging.getLogger(__name__)

KIND = "weights"  # the cache root's subdirectory
FORMAT = 1  # of an index; an index of another format is a miss
ALIGN = 64  # bytes: every tensor starts on a cache line (the kernels' vector loads)
CHECK_BYTES = 1 << 20  # the head and the tail of a data file whose digests the index keeps
LOCK_POLL_SECONDS = 0.5  # how often a process waiting for another's fill says it is still there
WRITE_CHUNK_BYTES = 64 << 20  # a tensor is written in slices of this size
ENGINE = Path(__file__).resolve().parent.parent
# What turns a checkpoint into the cached bytes: a change to any of them makes every entry a miss
SOURCES = ("model/quant.py", "model/gguf_repack.py", "model/gguf_loader.py", "model/gguf_file.py",
           "model/hf_loader.py", "model/llama.py", "model/olmo2.py", "model/layers.py", "model/weight_cache.py",
           "model/prepared_state.py", "backends/weight_ops.py", "backends/cpu_kernels.py", "backends/dispatch.py",
           "kernels/packed_linear.py")
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                                        torch.int8, torch.uint8, torch.int16, torch.int32,
                                                        torch.int64, torch.bool)}


def sources_digest(root: Path = ENGINE, names: tuple[str, ...] = SOURCES) -> str:
    """SHA-256 over the conversion's source files (a missing one counts as empty)."""
    digest = hashlib.sha256()
    for name in names:
        path = root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return digest.hexdigest()


def weight_key(checkpoint: Mapping[str, Any], dtype: torch.dtype, formats: Any, backend: Mapping[str, Any],
               architecture: str) -> dict[str, Any]:
    """The key of a model's converted weights: `checkpoint` (identity.checkpoint_key), the serving dtype,
    `formats` (what each weight loads as, JSON-ready), the backend's `describe()`, the model class's name."""
    return {"checkpoint": dict(checkpoint), "dtype": str(dtype).removeprefix("torch."), "formats": formats,
            "backend": dict(backend), "architecture": architecture, "torch": torch.__version__,
            "sources": sources_digest()}


@dataclass(frozen=True)
class Entry:
    """One key's files under a cache root."""

    directory: Path
    digest: str
    key: dict[str, Any]

    @staticmethod
    def of(root: str | os.PathLike, key: dict[str, Any]) -> Entry:
        return Entry(Path(root) / KIND, key_digest(key)[:32], key)

    @property
    def index(self) -> Path:
        return self.directory / f"{self.digest}.index"

    @property
    def data(self) -> Path:
        return self.directory / f"{self.digest}.data"

    @property
    def lock(self) -> Path:
        return self.directory / f"{self.digest}.lock"

    @property
    def temp_prefix(self) -> str:
        """Of the files a writer of this entry fills before renaming them into place."""
        return f".tmp-{self.digest}-"


# ---------------------------------------------------------------- reading

class Stored(NamedTuple):
    tensors: dict[str, torch.Tensor]  # views of the mapped data file
    notes: dict[str, Any]  # what the writer said beside the tensors (JSON)


def read(entry: Entry) -> Stored | None:
    """Every tensor of a sound entry, as views of its mapped data file, and its notes; None for a miss or a
    damaged entry."""
    try:
        index = json.loads(entry.index.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _bad(entry, f"unreadable ({exc})")
    problem = _problem(entry, index)
    if problem:
        return _bad(entry, problem)
    return Stored(_views(_mapped(entry.data, index["data_size"]), index["tensors"]), index.get("notes", {}))


def _bad(entry: Entry, problem: str) -> None:
    log.warning("weight cache entry %s is %s; treated as a miss and rebuilt", entry.index, problem,
                extra={"cache_entry": str(entry.index), "problem": problem})
    return None


def _problem(entry: Entry, index: Any) -> str:
    """What is wrong with an entry whose index reads as `index`; "" for a sound one."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return "of another format"
    if index.get("key") != json.loads(json.dumps(entry.key)):
        return "another key's"
    try:
        size = entry.data.stat().st_size
    except FileNotFoundError:
        return "without its data file"
    if size != index.get("data_size"):
        return f"truncated or overwritten (data file of {size} bytes, {index.get('data_size')} expected)"
    if _ends_digest(entry.data, size) != index.get("ends_sha256"):
        return "corrupt (its data file's first or last MiB does not match the index)"
    return ""


def _ends_digest(path: Path, size: int) -> str:
    """SHA-256 of the first CHECK_BYTES and the last CHECK_BYTES of a file of `size` bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(CHECK_BYTES))
        handle.seek(max(0, size - CHECK_BYTES))
        digest.update(handle.read(CHECK_BYTES))
    return digest.hexdigest()


def _mapped(path: Path, size: int) -> torch.Tensor:
    """The file as one uint8 tensor over a private mapping (the tensor keeps the mapping alive)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    with path.open("rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _views(data: torch.Tensor, layout: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name, place in layout.items():
        if "alias" in place:
            continue
        dtype, shape = DTYPES[place["dtype"]], tuple(place["shape"])
        count = math.prod(shape) * dtype.itemsize
        tensors[name] = data[place["offset"]:place["offset"] + count].view(dtype).view(shape)
    for name, place in layout.items():
        if "alias" in place:
            tensors[name] = tensors[place["alias"]]
    return tensors


# ---------------------------------------------------------------- writing

@contextlib.contextmanager
def filling(entry: Entry, waiting: Callable[[], None] = lambda: None) -> Iterator[bool]:
    """Holds the entry's fill lock (one process fills an entry at a time) and gives True; `waiting()` is called
    every LOCK_POLL_SECONDS while another process holds it. Gives False, logged, where the cache directory cannot
    be made or written (the caller converts without storing)."""
    try:
        entry.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(entry.lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        log.warning("weight cache %s cannot be written (%s); the weights are converted without it",
                    entry.directory, exc)
        yield False
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waiting()
                time.sleep(LOCK_POLL_SECONDS)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def write(entry: Entry, tensors: Mapping[str, torch.Tensor], notes: Mapping[str, Any] | None = None) -> None:
    """Stores the tensors (strided CPU tensors) and JSON `notes` as the entry (call it under `filling`): the old
    index goes, the data file is written and renamed into place, then the new index. OSError where the cache
    cannot be written."""
    layout, size = _layout(tensors)
    entry.directory.mkdir(parents=True, exist_ok=True)
    for path in [entry.index, *entry.directory.glob(f"{entry.temp_prefix}*")]:  # under the lock: a dead writer's
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    replace_file(entry.data, lambda out: _write_data(out, tensors, layout), entry.temp_prefix, entry.data.suffix)
    index = {"format": FORMAT, "key": entry.key, "data_size": size,
             "ends_sha256": _ends_digest(entry.data, size), "tensors": layout, "notes": dict(notes or {})}
    replace_file(entry.index, lambda out: out.write(json.dumps(index).encode()), entry.temp_prefix,
                 entry.index.suffix)


def prune_stale(entry: Entry, same: Callable[[dict[str, Any]], bool]) -> int:
    """Removes the other entries of the directory whose key `same(key)` says is this entry's checkpoint and
    options but an outdated identity or build (a rewritten file, other sources, another torch), which no start
    would find again; an entry another process is filling is left. Returns how many went."""
    removed = 0
    for index in entry.directory.glob("*.index"):
        other = Entry(entry.directory, index.stem, {})
        if other.digest == entry.digest:
            continue
        try:
            key = json.loads(index.read_text()).get("key")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(key, dict) and same(key) and _remove_unlocked(other):
            removed += 1
    return removed


def _remove_unlocked(entry: Entry) -> bool:
    """Deletes an entry's files unless its lock is held; whether it did."""
    fd = os.open(entry.lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        for path in (entry.index, entry.data, entry.lock):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    finally:
        os.close(fd)
    return True


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
    """Each name's place ({offset, dtype, shape}, or {alias: the first name of the same bytes}) and the size."""
    layout: dict[str, Any] = {}
    seen: dict[tuple, str] = {}
    end = 0
    for name, tensor in tensors.items():
        same = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and same in seen:
            layout[name] = {"alias": seen[same]}
            continue
        seen[same] = name
        offset = -(-end // ALIGN) * ALIGN
        layout[name] = {"offset": offset, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape)}
        end = offset + tensor.numel() * tensor.element_size()
    return layout, end


def _write_data(out, tensors: Mapping[str, torch.Tensor], layout: Mapping[str, Any]) -> None:
    for name, place in layout.items():
        if "alias" in place:
            continue
        out.seek(place["offset"])
        raw = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, raw.numel(), WRITE_CHUNK_BYTES):
            out.write(memoryview(raw[start:start + WRITE_CHUNK_BYTES].numpy()))


