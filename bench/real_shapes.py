"""Random-weight checkpoints of real model shapes, for load time, memory and decode speed at size without a download.

    python -m bench.real_shapes --shape llama-3.2-1b[,llama-3.2-3b,...] --format q4_k_m[,bf16,...] [--out DIR]
        [--seed 0] [--force]

Shapes (SHAPES) take their figures from each model's published config.json: llama-3.2-1b, llama-3.2-3b,
llama-3.1-8b and qwen2.5-1.5b (the Instruct model's context; Qwen2's q/k/v biases). Formats:
- safetensors: a Hugging Face folder NAME-random/ (config.json, model.safetensors in bf16, tokenizer.json,
  tokenizer_config.json);
- bf16, q8_0, q4_0, q4_k_m: NAME-random.TYPE.gguf, with llama.cpp's tensor names, metadata keys and, per format,
  its tensor types: bf16 and q8_0 as convert_hf_to_gguf.py writes them (every matrix in that type), q4_0 and
  q4_k_m as llama-quantize makes them (the LM head, or the embedding where it is tied, in Q6_K; Q4_K_M also puts
  attn_v and ffn_down in Q6_K in the layers its use_more_bits rule picks). Norms and biases stay F32, Llama's Q
  and K rows are permuted as llama.cpp stores them, and Llama 3's rope scaling goes in as rope_freqs.weight.
  The quantisers are bench/gguf_quant.py's.

Weights: each matrix normal * 0.02 from a generator seeded by (--seed, the tensor's name), the same values in
every format (a format's file differs from another's only by its rounding); norms ones, biases normal * 0.02.
The tokenizer is the default model's (SmolLM2's byte-level BPE, its chat template and special ids) padded with
`[PADn]` tokens (llama.cpp's filler, type UNUSED) up to the shape's vocabulary, so that `LLM(model=path)` works;
config.json's bos and eos ids are that tokenizer's.

Each tensor is generated, rounded and written before the next, so memory holds one tensor (an 8B model's
embedding: 2.1 GB of float32) rather than the model. Progress (tensor k of n, bytes written) goes to stderr, the
paths to stdout. A checkpoint is written under a temporary name and renamed once complete; one that exists is
kept unless --force.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, Mapping

import gguf
import numpy as np

from bench.gguf_quant import quantize
from engine.model.gguf_file import GGUFFile
from engine.model.gguf_loader import default_model_path
from engine.model.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
STD = 0.02  # transformers' initializer_range for these models
PAD_TOKEN = "[PAD{}]"  # llama.cpp's filler for ids its vocabulary lacks
LLAMA3_ROPE = MappingProxyType({"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"})


@dataclass(frozen=True)
class Shape:
    """A model's shape: the config.json fields that decide its tensors and its GGUF metadata."""

    title: str  # the published model's name
    model_type: str  # config.json's model_type, which is also the GGUF architecture
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    context: int
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: Mapping[str, Any] | None = None  # config.json's rope_scaling (llama3 only)

    def __post_init__(self) -> None:
        if self.model_type not in ("llama", "qwen2"):
            raise ValueError(f"shape {self.title}: model_type {self.model_type!r}; expected llama or qwen2")
        sizes = (self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.vocab)
        if min(sizes) < 1 or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"shape {self.title}: sizes {sizes} are not positive, or heads not a multiple of KV "
                             "heads, or head_dim odd")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"shape {self.title}: rope_scaling {dict(self.rope_scaling)}; expected llama3 or none")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2"


SHAPES: Mapping[str, Shape] = MappingProxyType({
    "llama-3.2-1b": Shape("Llama-3.2-1B", "llama", layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                          head_dim=64, vocab=128256, tied=True, context=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5, rope_scaling=LLAMA3_ROPE),
    "llama-3.2-3b": Shape("Llama-3.2-3B", "llama", layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8,
                          head_dim=128, vocab=128256, tied=True, context=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5, rope_scaling=LLAMA3_ROPE),
    "llama-3.1-8b": Shape("Llama-3.1-8B", "llama", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                          head_dim=128, vocab=128256, tied=False, context=131072, rope_theta=500000.0,
                          rms_norm_eps=1e-5, rope_scaling={**LLAMA3_ROPE, "factor": 8.0}),
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B-Instruct", "qwen2", layers=28, hidden=1536, intermediate=8960, heads=12,
                          kv_heads=2, head_dim=128, vocab=151936, tied=True, context=32768, rope_theta=1000000.0,
                          rms_norm_eps=1e-6),
})


@dataclass(frozen=True)
class Format:
    label: str  # in the file name, as llama.cpp's files spell it
    file_type: gguf.LlamaFileType | None  # general.file_type; None: the Hugging Face folder


FORMATS: Mapping[str, Format] = MappingProxyType({
    "safetensors": Format("safetensors", None), "bf16": Format("BF16", gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": Format("Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0), "q4_0": Format("Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_k_m": Format("Q4_K_M", gguf.LlamaFileType.MOSTLY_Q4_K_M),
})


@dataclass(frozen=True)
class TensorSpec:
    hf: str  # the Hugging Face name
    gguf: str  # llama.cpp's name
    dims: tuple[int, ...]  # numpy order: (out, in) for a matrix

    @property
    def is_matrix(self) -> bool:
        return len(self.dims) == 2


# ---------------------------------------------------------------- the tensors


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """Every weight of the model (Qwen2's q/k/v biases too), embedding first, the final norm and head last."""
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, f = shape.hidden, shape.intermediate
    specs = [TensorSpec("model.embed_tokens.weight", "token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        parts = [("input_layernorm", "attn_norm", (h,)), ("self_attn.q_proj", "attn_q", (q_rows, h)),
                 ("self_attn.k_proj", "attn_k", (kv_rows, h)), ("self_attn.v_proj", "attn_v", (kv_rows, h)),
                 ("self_attn.o_proj", "attn_output", (h, q_rows)), ("post_attention_layernorm", "ffn_norm", (h,)),
                 ("mlp.gate_proj", "ffn_gate", (f, h)), ("mlp.up_proj", "ffn_up", (f, h)),
                 ("mlp.down_proj", "ffn_down", (h, f))]
        specs += [TensorSpec(f"{hf}{a}.weight", f"{blk}{b}.weight", dims) for a, b, dims in parts]
        if shape.qkv_bias:
            specs += [TensorSpec(f"{hf}self_attn.{p}_proj.bias", f"{blk}attn_{p}.bias", (rows,))
                      for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]
    specs.append(TensorSpec("model.norm.weight", "output_norm.weight", (h,)))
    if not shape.tied:
        specs.append(TensorSpec("lm_head.weight", "output.weight", (shape.vocab, h)))
    return specs


def tensor_values(spec: TensorSpec, seed: int) -> np.ndarray:
    """float32 weights in Hugging Face's layout: ones for a norm, normal * STD seeded by (seed, name) otherwise."""
    if "norm" in spec.hf:
        return np.ones(spec.dims, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(spec.hf.encode())])
    values = rng.standard_normal(spec.dims, dtype=np.float32)
    values *= np.float32(STD)
    return values


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of Llama's Q and K rows: each head's two halves interleaved (its rope pairs neighbours)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K: the first
    and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_type(fmt: str, spec: TensorSpec, shape: Shape) -> gguf.GGMLQuantizationType:
    """The tensor's type in a `fmt` file, as llama.cpp's converter (bf16, q8_0) or llama-quantize picks it."""
    if not spec.is_matrix:
        return Q.F32
    if fmt in ("bf16", "q8_0"):
        return Q[fmt.upper()]
    if spec.gguf == "output.weight" or (shape.tied and spec.gguf == "token_embd.weight"):
        return Q.Q6_K  # llama-quantize's LM head, for every 4-bit format
    if fmt == "q4_0":
        return Q.Q4_0
    part, layer = spec.gguf.split(".")[-2], spec.gguf.split(".")[1]
    if part in ("attn_v", "ffn_down") and use_more_bits(int(layer), shape.layers):
        return Q.Q6_K
    return Q.Q4_K


def gguf_data(spec: TensorSpec, shape: Shape, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """The tensor as the file stores it: float32 for F32, else the type's bytes."""
    values = tensor_values(spec, seed)
    if shape.model_type == "llama" and spec.gguf.split(".")[-2] in ("attn_q", "attn_k"):
        values = llama_cpp_permute(values, shape.heads if ".attn_q." in spec.gguf else shape.kv_heads)
    return values if qtype == Q.F32 else quantize(values, qtype)


def rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3's rope scaling as llama.cpp's converter writes it: each frequency's divisor (float32)."""
    scaling = shape.rope_scaling or {}
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float32) / shape.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, middle)).astype(
        np.float32)


# ---------------------------------------------------------------- the tokenizer


def tokenizer_metadata(vocab: int) -> dict[str, Any]:
    """The default model's GGUF tokenizer metadata with its token list padded to `vocab` ids."""
    meta = {k: v for k, v in GGUFFile(default_model_path()).metadata.items() if k.startswith("tokenizer.")}
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the default model's tokenizer ({len(tokens)} tokens); "
                         "expected at least that many")
    padding = range(len(tokens), vocab)
    meta["tokenizer.ggml.tokens"] = tokens + [PAD_TOKEN.format(i) for i in padding]
    meta["tokenizer.ggml.token_type"] = types + [gguf.TokenType.UNUSED.value] * len(padding)
    return meta


def add_tokenizer(writer: gguf.GGUFWriter, meta: Mapping[str, Any]) -> None:
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            add(meta[f"tokenizer.ggml.{key}_token_id"])
    writer.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    writer.add_add_space_prefix(bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    writer.add_chat_template(meta["tokenizer.chat_template"])


def write_hf_tokenizer(folder: Path, meta: Mapping[str, Any], context: int) -> None:
    """tokenizer.json and tokenizer_config.json for the same tokenizer, built as the engine builds it from GGUF."""
    tokenizer = Tokenizer.from_gguf(SimpleNamespace(metadata=meta))  # from_gguf reads only `.metadata`
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    named = {name: tokens[meta[key]] for name, key in (("bos_token", "tokenizer.ggml.bos_token_id"),
                                                       ("eos_token", "tokenizer.ggml.eos_token_id"),
                                                       ("unk_token", "tokenizer.ggml.unknown_token_id"),
                                                       ("pad_token", "tokenizer.ggml.padding_token_id"))
             if key in meta}
    config = {**named, "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "chat_template": meta["tokenizer.chat_template"], "model_max_length": context,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------- GGUF


def add_model_metadata(writer: gguf.GGUFWriter, shape: Shape, fmt: str) -> None:
    """The hyper-parameters under llama.cpp's keys, as its converter writes them for this architecture."""
    writer.add_type("model")
    writer.add_name(f"{shape.title} (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if shape.model_type == "llama":  # Llama's configs give head_dim; the converter writes it and the vocab size
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_vocab_size(shape.vocab)
        writer.add_rope_dimension_count(shape.head_dim)
    writer.add_file_type(FORMATS[fmt].file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(path: Path, shape: Shape, fmt: str, seed: int, progress: Progress) -> None:
    """Header, metadata and tensor infos first, then each tensor in turn, generated as it is written."""
    specs = tensor_specs(shape)
    types = {spec.gguf: gguf_type(fmt, spec, shape) for spec in specs}
    check_blocks(shape, specs, types)
    factors = rope_factors(shape) if shape.rope_scaling else None
    writer = gguf.GGUFWriter(path, shape.model_type)
    try:
        add_model_metadata(writer, shape, fmt)
        add_tokenizer(writer, tokenizer_metadata(shape.vocab))
        if factors is not None:
            writer.add_tensor_info("rope_freqs.weight", factors.shape, factors.dtype, factors.nbytes)
        for spec in specs:
            add_tensor_info(writer, spec, types[spec.gguf])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if factors is not None:
            writer.write_tensor_data(factors)
        progress.start(len(specs), sum(stored_bytes(spec, types[spec.gguf]) for spec in specs))
        for spec in specs:
            data = gguf_data(spec, shape, types[spec.gguf], seed)
            writer.write_tensor_data(data)
            progress.tensor(spec.gguf, types[spec.gguf].name, data.nbytes)
    finally:
        writer.close()


def check_blocks(shape: Shape, specs: list[TensorSpec], types: Mapping[str, gguf.GGMLQuantizationType]) -> None:
    """Before anything is written: every row splits into its type's blocks (llama.cpp would pick another type)."""
    for spec in specs:
        block = gguf.GGML_QUANT_SIZES[types[spec.gguf]][0]
        if spec.dims[-1] % block:
            raise ValueError(f"{shape.title}: {spec.gguf} has rows of {spec.dims[-1]} values, which do not split "
                             f"into {types[spec.gguf].name} blocks of {block}")


def add_tensor_info(writer: gguf.GGUFWriter, spec: TensorSpec, qtype: gguf.GGMLQuantizationType) -> None:
    """F32 as float32 values, every other type as its bytes (GGUFWriter's raw form)."""
    if qtype == Q.F32:
        writer.add_tensor_info(spec.gguf, spec.dims, np.dtype(np.float32), stored_bytes(spec, qtype))
    else:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(spec.dims, qtype)
        writer.add_tensor_info(spec.gguf, byte_shape, np.dtype(np.uint8), stored_bytes(spec, qtype), qtype)


def stored_bytes(spec: TensorSpec, qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(spec.dims) // block * size


# ---------------------------------------------------------------- Hugging Face folder


def hf_config(shape: Shape, meta: Mapping[str, Any]) -> dict[str, Any]:
    """config.json as the published one, with the bos and eos ids of the tokenizer it ships with here."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.model_type]
    config = {"architectures": [arch], "model_type": shape.model_type, "hidden_act": "silu",
              "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
              "max_position_embeddings": shape.context, "rms_norm_eps": shape.rms_norm_eps,
              "rope_theta": shape.rope_theta, "rope_scaling": dict(shape.rope_scaling or {}) or None,
              "tie_word_embeddings": shape.tied, "initializer_range": STD, "torch_dtype": "bfloat16",
              "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
              "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"), "use_cache": True}
    if shape.model_type == "llama":
        config |= {"head_dim": shape.head_dim, "attention_bias": False, "mlp_bias": False}
    else:
        config |= {"use_sliding_window": False, "sliding_window": shape.context}
    return config


def write_safetensors(path: Path, specs: list[TensorSpec], seed: int, progress: Progress) -> None:
    """One bf16 safetensors file, written tensor by tensor: the header (JSON, padded with spaces to 8 bytes, as
    the safetensors library does) gives every tensor's offsets up front."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = math.prod(spec.dims) * 2
        header[spec.hf] = {"dtype": "BF16", "shape": list(spec.dims), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    progress.start(len(specs), offset)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for spec in specs:
            data = quantize(tensor_values(spec, seed), Q.BF16)
            data.tofile(out)
            progress.tensor(spec.hf, "BF16", data.nbytes)


def write_folder(folder: Path, shape: Shape, seed: int, progress: Progress) -> None:
    folder.mkdir()
    meta = tokenizer_metadata(shape.vocab)
    (folder / "config.json").write_text(json.dumps(hf_config(shape, meta), indent=2))
    write_hf_tokenizer(folder, meta, shape.context)
    write_safetensors(folder / "model.safetensors", tensor_specs(shape), seed, progress)


# ---------------------------------------------------------------- driving


class Progress:
    """Tensor k of n and the bytes written so far, one line per tensor on stderr."""

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label, self.stream = label, stream if stream is not None else sys.stderr
        self.count = self.done = self.total = self.written = 0

    def start(self, count: int, total: int) -> None:
        self.count, self.total, self.done, self.written = count, total, 0, 0

    def tensor(self, name: str, kind: str, nbytes: int) -> None:
        self.done += 1
        self.written += nbytes
        print(f"{self.label}: tensor {self.done}/{self.count} {name} {kind}, {self.written / 2**20:,.1f} of "
              f"{self.total / 2**20:,.1f} MiB written", file=self.stream, flush=True)


def output_path(out: Path, name: str, fmt: str) -> Path:
    return out / f"{name}-random" if fmt == "safetensors" else out / f"{name}-random.{FORMATS[fmt].label}.gguf"


def generate(shape: Shape, name: str, fmt: str, out: Path, seed: int = 0, force: bool = False,
             stream: Any = None) -> Path:
    """Writes `name` (`shape`) in `fmt` into `out` unless it is there already (or `force`); returns its path."""
    target = output_path(out, name, fmt)
    if target.exists() and not force:
        print(f"{target} exists; kept (--force rewrites it)", file=stream or sys.stderr)
        return target
    out.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    progress = Progress(f"{name} {FORMATS[fmt].label}", stream)
    try:
        if fmt == "safetensors":  # (a folder that --force replaces is removed just before the rename)
            write_folder(temporary, shape, seed, progress)
        else:
            write_gguf(temporary, shape, fmt, seed, progress)
        _replace(temporary, target)
    finally:
        _remove(temporary)
    return target


def _replace(source: Path, target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(source, target)  # a file over a file atomically; a folder once the old one is gone


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _choices(text: str, known: Mapping[str, Any], what: str) -> list[str]:
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        named = ", ".join(unknown) or repr(text)
        raise argparse.ArgumentTypeError(f"unknown {what} {named}; expected a comma-separated list of "
                                         f"{', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True, type=lambda s: _choices(s, SHAPES, "shape"),
                        help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--format", required=True, type=lambda s: _choices(s, FORMATS, "format"),
                        help=f"comma-separated: {', '.join(FORMATS)}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/real-shapes"),
                        help="folder for the checkpoints (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (with each tensor's name)")
    parser.add_argument("--force", action="store_true", help="rewrite checkpoints that exist")
    args = parser.parse_args(argv)
    for name in args.shape:
        for fmt in args.format:
            print(generate(SHAPES[name], name, fmt, args.out, args.seed, args.force), flush=True)


if __name__ == "__main__":
    main()
