"""Hugging Face model folders: config.json and *.safetensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig, RopeScaling
from engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def read_hf_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{folder} is a {model_type or 'unknown'!s} model; expected one of "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    windowed = (raw.get("use_sliding_window") or (model_type == "mistral" and raw.get("sliding_window"))
                or any(kind != "full_attention" for kind in raw.get("layer_types") or ()))
    if raw.get("mlp_bias") or windowed:
        raise ModelLoadError(f"{folder} uses MLP bias or sliding-window attention, which this server does not support")
    is_qwen2 = model_type == "qwen2"
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(raw), rope_scaling=_rope_scaling(raw),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=is_qwen2 or raw.get("attention_bias", False),
        attention_out_bias=not is_qwen2 and raw.get("attention_bias", False),
        qk_norm=model_type == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        architecture=SUPPORTED_ARCHITECTURES[model_type],
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope_theta(raw: dict[str, Any]) -> float:
    return float(raw.get("rope_theta") or _rope_parameters(raw).get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(raw)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"rope scaling {kind!r} is not supported; expected llama3, linear or none")
    return RopeScaling(kind=kind, factor=float(params["factor"]),
                       low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                       original_max_position=int(params.get("original_max_position_embeddings", 8192)))


def iter_hf_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights; expected a Hugging Face model folder")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
