"""The converted-weights cache (engine/model/weight_cache.py, engine/model/prepared_state.py): an entry's files
written and mapped back, a hit that converts nothing, a miss on a changed checkpoint or kernel build, a damaged or
half-written entry rebuilt, two processes filling one entry at once, and the same greedy tokens with and without
the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import select_backend, weight_ops
from engine.model import prepared_state, weight_cache
from engine.model.loader import resolve_model
from engine.model.weight_cache import CHECK_BYTES, Entry
from tests.tiny_models import tiny_llama_config, write_tiny_model

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def model_dir(tmp_path):
    return write_tiny_model(tmp_path / "model", tiny_llama_config(num_key_value_heads=2,
                                                                  max_position_embeddings=256), seed=3)


class Conversions:
    """Counts loader.load_model calls made by prepared_state (each one a conversion)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = prepared_state.load_model

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(prepared_state, "load_model", counted)


def _load(model_dir: Path, root: Path, weight_dtype: str = "auto", describe=None):
    def backend_for(skeleton):
        backend = select_backend("cpu", torch.bfloat16, False)
        if describe is not None:
            backend.describe = describe
        return backend

    return prepared_state.load_prepared(resolve_model(model_dir), torch.bfloat16, weight_dtype, root, backend_for)


def _entries(root: Path) -> list[Path]:
    return sorted((root / weight_cache.KIND).glob("*.data"))


def _logits(model) -> torch.Tensor:
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    return model.compute_logits(hidden)


# ---------------------------------------------------------------- the entry's files


def test_written_tensors_map_back_with_shared_bytes_stored_once(tmp_path):
    base = torch.arange(40, dtype=torch.float32).view(5, 8)
    tensors = {"a": base, "b": torch.arange(7, dtype=torch.int8), "a_again": base,
               "c": torch.ones(3, 16, dtype=torch.bfloat16)}
    entry = Entry.of(tmp_path, {"model": "x"})
    weight_cache.write(entry, tensors, {"repack": ["c"]})
    stored = weight_cache.read(entry)
    assert stored is not None and stored.notes == {"repack": ["c"]}
    for name, tensor in tensors.items():
        assert stored.tensors[name].dtype == tensor.dtype and torch.equal(stored.tensors[name], tensor)
    assert stored.tensors["a_again"].data_ptr() == stored.tensors["a"].data_ptr()  # one copy of shared bytes
    assert all(t.data_ptr() % weight_cache.ALIGN == 0 for t in stored.tensors.values())
    index = json.loads(entry.index.read_text())
    assert index["tensors"]["a_again"] == {"alias": "a"}


def test_another_key_is_another_entry_and_a_missing_one_a_miss(tmp_path):
    one, other = Entry.of(tmp_path, {"build": "a"}), Entry.of(tmp_path, {"build": "b"})
    assert one.digest != other.digest
    weight_cache.write(one, {"t": torch.ones(4)})
    assert weight_cache.read(other) is None


@pytest.mark.parametrize("damage", ["first MiB", "last MiB", "truncated", "no data", "index garbage"])
def test_a_damaged_or_half_written_entry_is_a_miss(tmp_path, damage, caplog):
    entry = Entry.of(tmp_path, {"model": "y"})
    weight_cache.write(entry, {"big": torch.arange(3 * CHECK_BYTES // 4, dtype=torch.int32)})
    size = entry.data.stat().st_size
    if damage in ("first MiB", "last MiB"):
        with entry.data.open("r+b") as handle:
            handle.seek(10 if damage == "first MiB" else size - 10)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncated":  # a writer killed after the rename of an old index: sizes differ
        os.truncate(entry.data, size // 2)
    elif damage == "no data":
        entry.data.unlink()
    else:
        entry.index.write_text("{not json")
    assert weight_cache.read(entry) is None
    assert any("treated as a miss" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- a model through the cache


def test_a_second_load_maps_what_the_first_converted(model_dir, tmp_path, monkeypatch):
    conversions = Conversions(monkeypatch)
    first, _ = _load(model_dir, tmp_path)
    second, _ = _load(model_dir, tmp_path)
    assert conversions.count == 1 and len(_entries(tmp_path)) == 1
    assert torch.equal(_logits(first), _logits(second))
    assert all(p.device.type == "cpu" for p in second.parameters())


@pytest.mark.parametrize("cycle", [False, True])
def test_the_converted_copy_is_freed_and_collected_only_when_a_cycle_holds_it(model_dir, tmp_path, monkeypatch,
                                                                              cycle):
    """Once the cache entry is written, the start maps it and drops the converted model: by reference counting,
    without a full collection (0.2 s in a process with a large heap), unless a reference cycle holds it."""
    converted, collections = [], []
    real_load, real_collect = prepared_state.load_model, prepared_state.gc.collect

    def load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        if cycle:
            model.__dict__["itself"] = model
        converted.append(weakref.ref(model))
        return model

    monkeypatch.setattr(prepared_state, "load_model", load)
    monkeypatch.setattr(prepared_state.gc, "collect", lambda *a: collections.append(a) or real_collect(*a))
    _load(model_dir, tmp_path)
    assert len(converted) == 1 and converted[0]() is None
    assert len(collections) == (1 if cycle else 0)


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_quantised_weights_and_their_copies_come_back_exactly(model_dir, tmp_path, monkeypatch, weight_dtype):
    conversions = Conversions(monkeypatch)
    first, _ = _load(model_dir, tmp_path, weight_dtype)
    second, _ = _load(model_dir, tmp_path, weight_dtype)
    assert conversions.count == 1
    assert second.weight_dtype == weight_dtype
    assert torch.equal(_logits(first), _logits(second))


def test_a_changed_checkpoint_or_kernel_build_is_a_miss(model_dir, tmp_path, monkeypatch):
    conversions = Conversions(monkeypatch)
    _load(model_dir, tmp_path)
    config = model_dir / "config.json"
    config.write_text(config.read_text() + "\n")  # the same model, rewritten: another identity
    _load(model_dir, tmp_path)
    assert conversions.count == 2
    assert len(_entries(tmp_path)) == 1  # the old file's entry, which nothing can hit now, is gone

    def other_build():
        return {"backend": "cpu-kernels", "build_key": "another-build"}

    _load(model_dir, tmp_path, describe=other_build)
    assert conversions.count == 3 and len(_entries(tmp_path)) == 2  # another build's entry stays beside it
    _load(model_dir, tmp_path, describe=other_build)
    assert conversions.count == 3


def test_a_damaged_entry_is_rebuilt_and_then_hit(model_dir, tmp_path, monkeypatch):
    conversions = Conversions(monkeypatch)
    _load(model_dir, tmp_path)
    (data,) = _entries(tmp_path)
    os.truncate(data, data.stat().st_size - 1)
    left = data.parent / f".tmp-{data.stem}-killed.data"  # what a writer killed mid-write leaves
    left.write_bytes(b"partial")
    model, _ = _load(model_dir, tmp_path)
    assert conversions.count == 2 and not left.exists()
    _load(model_dir, tmp_path)
    assert conversions.count == 2
    assert torch.isfinite(_logits(model)).all()


def test_an_index_that_does_not_fit_the_model_is_rebuilt(model_dir, tmp_path, monkeypatch):
    conversions = Conversions(monkeypatch)
    _load(model_dir, tmp_path)
    (data,) = _entries(tmp_path)
    index_path = data.with_suffix(".index")
    index = json.loads(index_path.read_text())
    index["tensors"].pop("param/norm.weight")
    index_path.write_text(json.dumps(index))
    _load(model_dir, tmp_path)
    assert conversions.count == 2


CHILD = """
import sys, time, torch
from engine.backends import select_backend, weight_ops
from engine.model import prepared_state
from engine.model.loader import resolve_model
real, converted = prepared_state.load_model, []
# the converter holds the fill lock a while, so that the other process surely finds it held
prepared_state.load_model = lambda *a, **k: converted.append(1) or time.sleep(2) or real(*a, **k)
model, _ = prepared_state.load_prepared(resolve_model(sys.argv[1]), torch.bfloat16, "auto", sys.argv[2],
                                        lambda skeleton: select_backend("cpu", torch.bfloat16, False))
hidden = torch.ones(1, model.cfg.hidden_size, dtype=torch.bfloat16)
print(len(converted), float(model.compute_logits(hidden).sum()))
"""


@pytest.mark.process
def test_two_processes_filling_one_entry_convert_once(model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(tmp_path)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        results.append(out.split())
    assert sorted(r[0] for r in results) == ["0", "1"]  # one converted, the other waited and mapped its entry
    assert results[0][1] == results[1][1]
    assert len(_entries(tmp_path)) == 1 and not list((tmp_path / weight_cache.KIND).glob(".tmp-*"))


def test_greedy_tokens_are_the_same_with_and_without_the_cache(model_dir, tmp_path):
    params = SamplingParams(max_tokens=16, temperature=0)
    tokens = {}
    for run, mode in (("off", "off"), ("first", "on"), ("warm", "on")):
        llm = LLM(str(model_dir), weight_cache=mode, cache_dir=str(tmp_path), kv_cache_memory=16 << 20)
        tokens[run] = [o.token_ids for o in llm.generate(["Hello there", "a b c"], params)]
    assert tokens["off"] == tokens["first"] == tokens["warm"]
    assert len(_entries(tmp_path)) == 1


def test_a_cache_that_cannot_be_written_costs_only_the_conversion(model_dir, tmp_path, monkeypatch, caplog):
    conversions = Conversions(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for _ in range(2):
        model, _ = _load(model_dir, blocker / "cache")
        assert torch.isfinite(_logits(model)).all()
    assert conversions.count == 2 and "cannot be written" in caplog.text


def test_int8g_weights_with_and_without_offsets_come_back_exactly(tmp_path, monkeypatch):
    """auto on a Q4_K_M-style GGUF: int8g weights whose offsets the load dropped (Q6_K) and int4 ones (Q4_K, their
    scales blocked) map back into the skeleton's layout."""
    from tests import test_gguf_quants as mixed
    from tests.test_gguf_exact import MIXED

    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, MIXED)
    conversions = Conversions(monkeypatch)
    first, _ = _load(path, tmp_path / "cache")
    second, _ = _load(path, tmp_path / "cache")
    assert conversions.count == 1 and second.weight_dtype == "int8g+int4"
    assert weight_ops.int8g_flat_shape(second.layers[0].mlp.down_proj.weight_scale)[0] == 1  # Q6_K
    o_proj = second.layers[0].self_attn.o_proj
    assert o_proj.weight.dtype == torch.uint8 and o_proj.weight_scale.dim() == 4  # Q4_K: int4, blocked scales
    assert torch.equal(_logits(first), _logits(second))
