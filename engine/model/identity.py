"""A checkpoint's identity for on-disk caches: cheap for a file of many gigabytes, and different whenever the
file is replaced or rewritten.

`checkpoint_key(path)` is a JSON-ready dict: the real path, and for each file that makes up the checkpoint its
name, size and modification time (ns), plus a SHA-256 over the region that describes the weights: a GGUF's
header (metadata and tensor infos, up to where the tensor data starts), or a Hugging Face folder's
config.json and each safetensors file's JSON header. The tensor data itself is not read, so a rewrite that
keeps the size, the modification time and every header is the one change this misses.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFFile

SAFETENSORS_LENGTH = struct.Struct("<Q")  # the header's byte count, before the header itself
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit on a header


def checkpoint_key(path: str | os.PathLike) -> dict[str, Any]:
    """The identity of a .gguf file or a Hugging Face folder; ModelLoadError names a path that is neither."""
    real = Path(os.path.realpath(Path(path).expanduser()))
    if real.is_dir() and (real / "config.json").is_file():
        files, digest = _folder_files(real), hashlib.sha256()
        for file in files:
            digest.update(file.name.encode() + b"\0" + _described_region(file) + b"\0")
        return {"path": str(real), "files": [_stat(f) for f in files], "header_sha256": digest.hexdigest()}
    if real.is_file() and real.suffix == ".gguf":
        return {"path": str(real), "files": [_stat(real)], "header_sha256": _gguf_header_digest(real)}
    raise ModelLoadError(f"model {str(path)!r} is neither a Hugging Face folder with config.json nor a .gguf file")


def _folder_files(folder: Path) -> list[Path]:
    return [folder / "config.json"] + sorted(folder.glob("*.safetensors"))


def _stat(file: Path) -> list[Any]:
    st = file.stat()
    return [file.name, st.st_size, st.st_mtime_ns]


def _described_region(file: Path) -> bytes:
    """config.json whole; of a safetensors file, its length prefix and JSON header."""
    if file.suffix != ".safetensors":
        return file.read_bytes()
    with file.open("rb") as handle:
        prefix = handle.read(SAFETENSORS_LENGTH.size)
        if len(prefix) < SAFETENSORS_LENGTH.size:
            raise ModelLoadError(f"{file} is too short to be a safetensors file")
        (length,) = SAFETENSORS_LENGTH.unpack(prefix)
        if length > MAX_SAFETENSORS_HEADER:
            raise ModelLoadError(f"{file} announces a {length}-byte header; expected a safetensors file")
        return prefix + handle.read(length)


def _gguf_header_digest(file: Path) -> str:
    """SHA-256 of the bytes before the tensor data (GGUFFile parses the header; the data is mapped, not read)."""
    end = GGUFFile(file).data_offset
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        digest.update(handle.read(end))
    return digest.hexdigest()
