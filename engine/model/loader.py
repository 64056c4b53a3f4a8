"""Resolve `--model` (a Hugging Face folder, a .gguf file, a hub id already in the local Hugging Face cache, or
nothing for the default), check it against the model it describes, and build the model."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from engine.config import ConfigError, ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import default_model_path, read_gguf_lazily
from engine.model.hf_loader import hf_weight_shapes, iter_hf_weights, read_hf_config
from engine.model.llama import LlamaModel, build_model
from engine.model.olmo2 import Olmo2Model
from engine.model.progress import LOADING_WEIGHTS, Progress, counted
from engine.model.quant import FileBlocks, choose_weight_dtype
from engine.model.tokenizer import Tokenizer

DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what huggingface_hub accepts as "org/name"
# ModelConfig.architecture -> its model class, where that is not LlamaModel (the Llama family and Gemma 2/3)
MODEL_CLASSES: Mapping[str, type[LlamaModel]] = {"olmo2": Olmo2Model}


def model_class(config: ModelConfig) -> type[LlamaModel]:
    return MODEL_CLASSES.get(config.architecture, LlamaModel)


@dataclass(frozen=True)
class ModelSource:
    """Everything read from a checkpoint except the (possibly large) weights, which load on demand."""

    path: Path
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Callable[[], Iterable[tuple[str, torch.Tensor | FileBlocks]]]  # FileBlocks: GGUF's quantised blocks
    shapes: Callable[[], Mapping[str, tuple[int, ...]]]  # weight name -> shape, from the file headers alone
    types: Mapping[str, str] = field(default_factory=dict)  # GGUF: weight name -> its tensor type's name


def resolve_model(model: str | Path | None) -> ModelSource:
    """Reads the config and tokenizer (and GGUF tensor types), not the weights; ModelLoadError names what is wrong."""
    path = default_model_path() if model is None else Path(model).expanduser()
    name = None
    if model is not None and not path.exists() and HUB_ID.fullmatch(str(model)):
        path, name = hub_snapshot(str(model)), str(model)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, name or path.name, _hf_config(path), Tokenizer.from_hf_folder(path),
                           lambda: iter_hf_weights(path), lambda: hf_weight_shapes(path))
    if path.is_file() and path.suffix == ".gguf":
        lazy = read_gguf_lazily(path)
        return ModelSource(path, name or path.stem, lazy.config, lazy.tokenizer, lazy.weights, lambda: lazy.shapes,
                           lazy.types)
    if not path.exists():
        raise ModelLoadError(f"model {str(path)!r} does not exist; expected a Hugging Face folder with config.json "
                             "or a .gguf file")
    raise ModelLoadError(f"model {str(path)!r} is neither a Hugging Face folder with config.json nor a .gguf file")


def _hf_config(folder: Path) -> ModelConfig:
    try:
        return read_hf_config(folder)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} is not valid JSON ({exc})") from None
    except KeyError as exc:
        raise ModelLoadError(f"{folder / 'config.json'} lacks {exc.args[0]!r}; expected a complete model "
                             "config") from None
    except (ConfigError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{folder / 'config.json'} describes an inconsistent model ({exc})") from None


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repositories: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (~/.cache by default)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a hub model (the one refs/main names, else the newest): its folder, or its one
    .gguf file when it holds GGUF files and no config.json. Nothing is downloaded."""
    repo = hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    ref = repo / "refs" / "main"
    named = repo / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    snapshot = named if named is not None and named.is_dir() else (snapshots[-1] if snapshots else None)
    if snapshot is None:
        raise ModelLoadError(f"model {repo_id!r} is not a local path, and models load from a local Hugging Face "
                             f"folder or .gguf file: the local Hugging Face cache would hold it in {repo}, which "
                             f"has no snapshot (`huggingface-cli download {repo_id}` puts one there)")
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelLoadError(f"the cached snapshot {snapshot} of {repo_id!r} holds {len(ggufs)} .gguf files; pass "
                             f"one of them as the model: {', '.join(p.name for p in ggufs)}")
    raise ModelLoadError(f"the cached snapshot {snapshot} of {repo_id!r} has neither config.json nor a .gguf file; "
                         "expected a complete download")


def check_model(source: ModelSource) -> None:
    """Fits the checkpoint's tensor names and shapes into the model its config describes, on the meta device:
    the same checks as loading, without reading or allocating any weights. ModelLoadError when they do not fit."""
    with torch.device("meta"):
        model = model_class(source.config)(source.config, "meta")
        tensors = [(name, torch.empty(shape)) for name, shape in source.shapes().items()]
    try:
        model.load_weights(tensors)
    except (KeyError, RuntimeError, IndexError) as exc:  # a misplaced name, or a shape that does not fit
        detail = exc.args[0] if exc.args else type(exc).__name__
        raise ModelLoadError(f"{source.path} does not fit the {source.config.architecture} model its config "
                             f"describes: {detail}") from None


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """'auto' means bfloat16 (AMX on CPU, native on recent GPUs), float16 on GPUs without bf16."""
    if name != "auto":
        return DTYPE_NAMES[name]
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str = "cpu",
               weight_dtype: str = "auto", progress: Progress | None = None) -> LlamaModel:
    """`weight_dtype` (EngineConfig.weight_dtype): "int8" / "int4" quantise the projections and LM head as they
    load (a GGUF's Q4_0 / Q4_1 / Q4_K tensors go into int4 as stored); "auto" picks per projection by the GGUF
    file's tensor types (quant.choose_weight_dtype), bfloat16 for a folder. `progress` hears "loading weights"
    with each checkpoint tensor loaded."""
    check_model(source)  # before any memory is allocated: a mismatch fails with one sentence
    choice = choose_weight_dtype(weight_dtype, source.types, dtype, source.config.tie_word_embeddings,
                                 model_class(source.config).parameter_name)
    weights = counted(source.weights(), progress, LOADING_WEIGHTS, len(source.shapes()))
    return build_model(source.config, weights, dtype, device, choice, model_class(source.config))
