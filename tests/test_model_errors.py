"""Models that cannot load fail with one sentence, from `generate`, `serve` (before any actor spawns) and `LLM()`
alike; hub ids load from the local Hugging Face cache or say where it would hold them."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFFile
from engine.model.loader import check_model, hub_cache, resolve_model
from tests.test_gguf_loader import Q, write_gguf

REPO = Path(__file__).resolve().parent.parent
HUB_ID = "SomeOrg/tiny-llama"
CLI_TIMEOUT = 120


# ---------------------------------------------------------------- bad files, made once per module


def cut_in_half(good: bytes) -> bytes:
    return good[:len(good) // 2]


def bad_magic(good: bytes) -> bytes:
    return b"GGML" + good[4:]


def offset_past_end(good: bytes, path: Path) -> bytes:
    """The last tensor's data offset moved past the end of the file (its header entry, patched in place)."""
    file = GGUFFile(path)
    last = file.tensors[-1]
    name = last.name.encode()
    at = good.index(name + struct.pack("<I", len(last.shape)), good.index(b"tokenizer.chat_template"))
    offset_at = at + len(name) + 4 + 8 * len(last.shape) + 4
    (stored,) = struct.unpack_from("<Q", good, offset_at)
    assert stored + file.data_offset == last.offset  # patching the field the reader reads
    return good[:offset_at] + struct.pack("<Q", len(good)) + good[offset_at + 8:]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[Path, str]]:
    """name -> (model path, words the one-sentence error must hold)."""
    root = tmp_path_factory.mktemp("bad-models")
    write_gguf(root / "good.gguf", qtype=Q.Q8_0)
    good = (root / "good.gguf").read_bytes()
    files = {
        "half": (cut_in_half(good), "truncated"),
        "magic": (bad_magic(good), "not a GGUF file"),
        "offset": (offset_past_end(good, root / "good.gguf"), "truncated: tensor"),
    }
    models = {}
    for name, (data, words) in files.items():
        (root / f"{name}.gguf").write_bytes(data)
        models[name] = (root / f"{name}.gguf", words)
    for name, kwargs, words in [("mxfp4", {"qtype": Q.MXFP4}, "type MXFP4, which is not supported; expected one of"),
                                ("arch", {"arch": "gemma"}, "is a 'gemma' GGUF model; expected one of llama"),
                                ("t5", {"tokenizer_model": "t5"}, "tokenizer model 't5' is not supported")]:
        (root / name).mkdir()
        write_gguf(root / name / "m.gguf", **kwargs)
        models[name] = (root / name / "m.gguf", words)
    no_weights = root / "no-weights"
    no_weights.mkdir()
    for f in tiny_model_dir.glob("*.json"):
        shutil.copy(f, no_weights)
    models["no-weights"] = (no_weights, "has no *.safetensors weights")
    models["missing-tensor"] = (_without_a_tensor(tiny_model_dir, root / "missing-tensor"), "does not fit the llama")
    return models


def _without_a_tensor(source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    return folder


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT, env={**os.environ, **(env or {})})


# ---------------------------------------------------------------- in this process


@pytest.mark.unit
@pytest.mark.parametrize("name", ["half", "magic", "offset", "mxfp4", "arch", "t5", "no-weights", "missing-tensor"])
def test_each_bad_model_raises_one_model_load_error_before_loading_weights(bad_models, name):
    path, words = bad_models[name]
    with pytest.raises(ModelLoadError, match=None) as caught:
        check_model(resolve_model(str(path)))
    message = str(caught.value)
    assert words in message and "\n" not in message


@pytest.mark.unit
def test_a_mis_sized_tensor_does_not_fit(tiny_model_dir, tmp_path):
    folder = tmp_path / "resized"
    shutil.copytree(tiny_model_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="does not fit the llama model its config describes"):
        check_model(resolve_model(str(folder)))
    check_model(resolve_model(str(tiny_model_dir)))  # the intact model fits


@pytest.mark.unit
def test_a_gguf_tensor_of_another_architecture_fails_when_resolved(tmp_path, monkeypatch):
    import numpy as np

    from tests import test_gguf_loader

    plain = test_gguf_loader.tiny_tensors

    def with_an_expert_tensor(*args, **kwargs):
        return plain(*args, **kwargs) | {"blk.0.ffn_gate_exps.weight": ("experts", np.zeros((4, 32), np.float32))}

    monkeypatch.setattr(test_gguf_loader, "tiny_tensors", with_an_expert_tensor)
    write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_gate_exps.weight' is not part of"):
        resolve_model(str(tmp_path / "m.gguf"))


@pytest.mark.unit
@pytest.mark.parametrize("edit, words", [
    (lambda text: text[:-3], "is not valid JSON"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "num_attention_heads"}),
     "lacks 'num_attention_heads'"),
    (lambda text: json.dumps(json.loads(text) | {"model_type": "mamba"}), "is a mamba model; expected one of"),
])
def test_a_bad_config_json_gets_one_sentence(tiny_model_dir, tmp_path, edit, words):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "config.json").write_text(edit((folder / "config.json").read_text()))
    with pytest.raises(ModelLoadError, match=words):
        resolve_model(str(folder))


@pytest.mark.unit
def test_llm_raises_the_same_sentence(bad_models):
    from engine import LLM

    path, words = bad_models["mxfp4"]
    with pytest.raises(ModelLoadError, match=words):
        LLM(str(path), dtype="float32")


@pytest.mark.unit
def test_async_llm_with_actors_checks_the_model_before_spawning(bad_models):
    from client import AsyncLLM

    path, words = bad_models["missing-tensor"]
    with pytest.raises(ModelLoadError, match=words):
        AsyncLLM(str(path), decode_actors=1)  # no start(): the check runs in the constructor, in this process


# ---------------------------------------------------------------- the Hugging Face cache


def cache_snapshot(cache: Path, repo_id: str, source: Path, commit: str = "0123abcd", ref: bool = True) -> Path:
    """A snapshot laid out as huggingface_hub lays one: files in blobs/, symlinked from snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        blob = repo / "blobs" / f"{commit}-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "hf-home" / "hub"


@pytest.mark.unit
def test_the_cache_follows_hf_hub_cache_then_hf_home_then_xdg(empty_cache, monkeypatch, tmp_path):
    assert hub_cache() == empty_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "explicit"))
    assert hub_cache() == tmp_path / "explicit"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"


@pytest.mark.unit
def test_a_hub_id_not_in_the_cache_says_where_it_would_be(empty_cache):
    with pytest.raises(ModelLoadError) as caught:
        resolve_model(HUB_ID)
    message = str(caught.value)
    assert "models load from a local Hugging Face folder or .gguf file" in message
    assert str(empty_cache / "models--SomeOrg--tiny-llama") in message and "\n" not in message


@pytest.mark.unit
def test_a_cached_hub_id_loads_the_snapshot_refs_main_names(empty_cache, tiny_model_dir, bad_models):
    cache_snapshot(empty_cache, HUB_ID, bad_models["no-weights"][0], commit="stale", ref=False)
    snapshot = cache_snapshot(empty_cache, HUB_ID, tiny_model_dir, commit="0123abcd")
    source = resolve_model(HUB_ID)
    assert source.path == snapshot and source.name == HUB_ID
    check_model(source)  # the weights resolve through the blob symlinks
    assert source.config == resolve_model(str(tiny_model_dir)).config


@pytest.mark.unit
def test_a_cached_gguf_repository_loads_its_one_gguf_and_names_several(empty_cache, tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(one / "m.Q8_0.gguf", qtype=Q.Q8_0)
    cache_snapshot(empty_cache, "SomeOrg/one-GGUF", one)
    assert resolve_model("SomeOrg/one-GGUF").path.name == "m.Q8_0.gguf"
    shutil.copy(one / "m.Q8_0.gguf", one / "m.F32.gguf")
    cache_snapshot(empty_cache, "SomeOrg/two-GGUF", one)
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files; pass one of them as the model: m.F32.gguf, "
                                             "m.Q8_0.gguf"):
        resolve_model("SomeOrg/two-GGUF")


@pytest.mark.unit
def test_an_existing_local_folder_wins_over_the_cache(empty_cache, tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "SomeOrg").mkdir()
    shutil.copytree(tiny_model_dir, tmp_path / HUB_ID)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(HUB_ID).path == Path(HUB_ID)


# ---------------------------------------------------------------- the command line


def _only_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.mark.parametrize("name", ["half", "magic", "offset", "mxfp4", "arch", "t5", "no-weights", "missing-tensor"])
def test_generate_prints_one_sentence_and_exits_2(bad_models, name):
    path, words = bad_models[name]
    done = _cli("generate", "hi", "--model", str(path), "--dtype", "float32", "--max-tokens", "2")
    assert done.returncode == 2, done.stderr
    assert words in _only_error_line(done.stderr)
    assert done.stdout == ""


@pytest.mark.parametrize("name", ["arch", "missing-tensor"])
def test_chat_prints_the_same_sentence_before_its_banner(bad_models, name):
    path, words = bad_models[name]
    done = subprocess.run([sys.executable, "cli.py", "chat", "--model", str(path)], cwd=REPO, input="hello\n",
                          capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert done.returncode == 2, done.stderr
    assert words in _only_error_line(done.stderr) and "chatting with" not in done.stderr


def _serve_events(stderr: str) -> list[dict]:
    assert "Traceback" not in stderr, stderr
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("name", ["mxfp4", "t5", "offset", "no-weights", "missing-tensor"])
def test_serve_with_actors_refuses_the_model_before_any_actor_spawns(bad_models, name):
    path, words = bad_models[name]
    done = _cli("serve", "--model", str(path), "--port", "0", "--decode-actors", "1", "--log-format", "json")
    assert done.returncode == 2, done.stderr
    events = _serve_events(done.stderr)
    assert [e["event"] for e in events] == ["cannot start"], events  # no "starting engine", no actor's lines
    assert words in events[0]["error"] and "\n" not in events[0]["error"]


def test_serve_takes_the_model_as_its_positional_argument(bad_models):
    path, words = bad_models["t5"]
    done = _cli("serve", str(path), "--port", "0", "--log-format", "json")
    assert done.returncode == 2
    assert words in _serve_events(done.stderr)[0]["error"]


def test_serve_refuses_two_different_models(bad_models, tiny_model_dir):
    done = _cli("serve", str(tiny_model_dir), "--model", str(bad_models["t5"][0]), "--port", "0")
    assert done.returncode == 2
    assert "the model is given twice" in done.stderr and str(tiny_model_dir) in done.stderr


def test_generate_with_an_uncached_hub_id_says_where_the_cache_would_hold_it(tmp_path):
    done = _cli("generate", "hi", "--model", HUB_ID, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert done.returncode == 2
    line = _only_error_line(done.stderr)
    assert "models load from a local Hugging Face folder or .gguf file" in line
    assert str(tmp_path / "hub" / "models--SomeOrg--tiny-llama") in line


def test_generate_loads_a_hub_id_from_the_cache(tmp_path, tiny_model_dir):
    cache_snapshot(tmp_path / "hub", HUB_ID, tiny_model_dir)
    args = ("hi", "--dtype", "float32", "--max-tokens", "4", "--threads", "1")
    cached = _cli("generate", "--model", HUB_ID, *args, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    local = _cli("generate", "--model", str(tiny_model_dir), *args)
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == local.stdout and cached.stdout.strip()
