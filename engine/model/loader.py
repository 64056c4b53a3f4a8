"""Resolve `--model` (a Hugging Face folder, a .gguf file, or nothing for the default) and build the model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from engine.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import default_model_path, read_gguf_lazily
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import LlamaModel, build_model
from engine.tokenizer import Tokenizer

DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSource:
    """Everything read from a checkpoint except the (possibly large) weights, which load on demand."""

    path: Path
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]


def resolve_model(model: str | Path | None) -> ModelSource:
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, path.name, read_hf_config(path), Tokenizer.from_hf_folder(path),
                           lambda: iter_hf_weights(path))
    if path.is_file() and path.suffix == ".gguf":
        config, tokenizer, weights = read_gguf_lazily(path)
        return ModelSource(path, path.stem, config, tokenizer, weights)
    raise ModelLoadError(f"model {str(path)!r} is neither a Hugging Face folder with config.json nor a .gguf file")


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """'auto' means bfloat16 (AMX on CPU, native on recent GPUs), float16 on GPUs without bf16."""
    if name != "auto":
        return DTYPE_NAMES[name]
    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str = "cpu") -> LlamaModel:
    return build_model(source.config, source.weights(), dtype, device)
