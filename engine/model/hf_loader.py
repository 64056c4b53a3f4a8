"""Hugging Face model folders: config.json and *.safetensors."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig, RopeScaling
from engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                           "gemma2": "gemma2", "gemma3_text": "gemma3", "olmo2": "olmo2"}
GEMMA = ("gemma2", "gemma3_text")
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Gemma's configs give the layer pattern as a period when they list no layer_types: layer i is windowed unless
# (i + 1) is a multiple of it (transformers' own default: 2 for Gemma 2, 6 for Gemma 3)
DEFAULT_WINDOW_PERIOD = {"gemma2": 2, "gemma3_text": 6}
# transformers' config defaults for the keys a config.json may leave out (an explicit null stays None)
GEMMA_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=4096),
    "gemma3_text": dict(query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window=4096),
}
MISTRAL_DEFAULT_WINDOW = 4096


def read_hf_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{folder} is a {model_type or 'unknown'!s} model; expected one of "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Gemma 3 as a text-only gemma3_text "
                             "checkpoint)")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{folder} uses MLP bias, which this server does not support")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{folder} uses bidirectional attention (an embedding model); expected a causal "
                             "decoder")
    gemma = model_type in GEMMA
    is_qwen2 = model_type == "qwen2"
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    global_rope, local_theta = _gemma3_rope(raw) if model_type == "gemma3_text" else (raw, None)
    window, sliding_layers = _sliding_window(raw, model_type, folder)
    if gemma:
        raw = {**GEMMA_DEFAULTS[model_type], **raw}
    return ModelConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(global_rope),
        rope_scaling=_rope_scaling(global_rope),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
        attention_bias=is_qwen2 or raw.get("attention_bias", False),
        attention_out_bias=not is_qwen2 and raw.get("attention_bias", False),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        architecture=SUPPORTED_ARCHITECTURES[model_type],
        sliding_window=window, sliding_layers=sliding_layers,
        **(_gemma_fields(raw, folder, local_theta) if gemma else {}),
    )


def _sliding_window(raw: dict[str, Any], model_type: str, folder: Path) -> tuple[int | None, tuple[bool, ...]]:
    """(window, per-layer windowed flags) as transformers applies them for this model type."""
    layer_types = raw.get("layer_types")
    if model_type == "mistral":  # every layer windowed when sliding_window is set
        return raw.get("sliding_window", MISTRAL_DEFAULT_WINDOW), ()
    if model_type in GEMMA:
        if not layer_types:
            period = raw.get("sliding_window_pattern") or DEFAULT_WINDOW_PERIOD[model_type]
            layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                           for i in range(raw["num_hidden_layers"])]
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ModelLoadError(f"{folder} has layer types {sorted(unknown)}; expected full_attention and "
                                 "sliding_attention")
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
        window = raw.get("sliding_window", GEMMA_DEFAULTS[model_type]["sliding_window"])
        return (window, sliding) if window is not None and any(sliding) else (None, ())
    if raw.get("use_sliding_window") or any(kind != "full_attention" for kind in layer_types or ()):
        raise ModelLoadError(f"{folder} is a {model_type} model with sliding-window attention, which this server "
                             "supports for Mistral, Gemma 2 and Gemma 3 only")
    return None, ()


def _gemma_fields(raw: dict[str, Any], folder: Path, local_theta: float | None) -> dict[str, Any]:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ModelLoadError(f"{folder} uses the activation {act!r}; expected gelu_pytorch_tanh")
    return dict(hidden_act=GEMMA_ACTIVATIONS[act], norm_weight_offset=1.0, scale_embeddings=True,
                sandwich_norms=True, query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
                attn_logit_softcap=raw.get("attn_logit_softcapping"),
                final_logit_softcap=raw.get("final_logit_softcapping"), rope_local_theta=local_theta)


def _gemma3_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's global-layer RoPE settings (in the shape _rope_theta / _rope_scaling read) and the unscaled
    base of its windowed layers: transformers' per-layer-type rope_parameters, or the older rope_theta,
    rope_scaling (global layers only) and rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise ModelLoadError(f"rope scaling {local['rope_type']!r} on Gemma 3's windowed layers is not "
                                 "supported; expected none there")
        return ({"rope_parameters": full, "rope_theta": full.get("rope_theta", 1e6)},
                float(local.get("rope_theta", 10000.0)))
    return ({"rope_theta": raw.get("rope_theta", 1e6), "rope_scaling": raw.get("rope_scaling")},
            float(raw.get("rope_local_base_freq", 10000.0)))


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
    for file in _weight_files(folder):
        with _open_safetensors(file) as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def hf_weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each weight's name and shape, from the safetensors headers alone (no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(folder):
        with _open_safetensors(file) as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights; expected a Hugging Face model folder")
    return files


def _open_safetensors(file: Path):
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for damaged files
        raise ModelLoadError(f"{file} could not be read as safetensors ({exc}); expected a complete "
                             "safetensors file") from None
