"""engine.model.identity.checkpoint_key: the same checkpoint gives the same key, and a checkpoint that changed
(its size, its modification time, or the header that describes its weights) gives another."""
from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest

from engine.model.errors import ModelLoadError
from engine.model.identity import checkpoint_key


@pytest.fixture
def folder(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def _write_gguf(path, name: str = "tiny") -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _keep_times(path, change) -> None:
    """Applies `change` to the file and puts its modification time back, as a copy that keeps times would."""
    st = os.stat(path)
    change(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_folder_key_is_stable_json_and_names_its_files(folder, tmp_path):
    key = checkpoint_key(folder)
    assert checkpoint_key(str(folder)) == key and json.loads(json.dumps(key)) == key
    assert key["path"] == str(folder.resolve())
    names = [name for name, _, _ in key["files"]]
    assert names[0] == "config.json" and any(n.endswith(".safetensors") for n in names)
    os.symlink(folder, tmp_path / "link")
    assert checkpoint_key(tmp_path / "link") == key  # the real path, whatever names it


def test_a_touched_weights_file_changes_the_folder_key(folder):
    before = checkpoint_key(folder)
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert checkpoint_key(folder) != before


def test_a_safetensors_header_change_of_the_same_size_and_time_changes_the_key(folder):
    weights = next(folder.glob("*.safetensors"))
    before = checkpoint_key(folder)

    def rename_a_tensor(path) -> None:
        data = bytearray(path.read_bytes())
        at = data.index(b'"model.')  # a tensor name inside the JSON header
        data[at + 1:at + 6] = b"MODEL"
        path.write_bytes(bytes(data))

    _keep_times(weights, rename_a_tensor)
    after = checkpoint_key(folder)
    assert after["files"] == before["files"] and after["header_sha256"] != before["header_sha256"]


def test_a_config_change_of_the_same_size_and_time_changes_the_key(folder):
    before = checkpoint_key(folder)
    _keep_times(folder / "config.json", lambda p: p.write_text(p.read_text().replace("1e-05", "2e-05")))
    assert checkpoint_key(folder)["header_sha256"] != before["header_sha256"]


def test_a_gguf_key_covers_its_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    _write_gguf(path, "tiny")
    key = checkpoint_key(path)
    assert key["files"] == [["m.gguf", path.stat().st_size, path.stat().st_mtime_ns]]
    assert checkpoint_key(path) == key
    _keep_times(path, lambda p: _write_gguf(p, "tinY"))  # same length, other metadata
    assert path.stat().st_size == key["files"][0][1]
    assert checkpoint_key(path)["header_sha256"] != key["header_sha256"]


def test_what_is_no_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    for path in (tmp_path / "notes.txt", tmp_path / "missing.gguf", tmp_path):
        with pytest.raises(ModelLoadError, match="neither a Hugging Face folder"):
            checkpoint_key(path)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        checkpoint_key(tmp_path / "broken.gguf")
