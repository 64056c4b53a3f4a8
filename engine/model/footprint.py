"""What an engine will hold resident, estimated from the checkpoint's header before anything loads, and the
refusal, in one sentence with the numbers, when that does not fit in the memory available.

The parts: the weights in the format the kernels read (`--weight-dtype` as quant.choose_weight_dtype resolves it:
the serving dtype's bytes per weight, int8 one byte and an fp32 scale per row, int4 half a byte and an fp16 scale
and offset per 32), the CPU kernels' packed copies of them (`packed_footprint`), the KV pool as the builder sizes
it (engine/kv/cache.choose_num_blocks), and an allowance for a step's activations and the process itself. A layout
of several engines (actors) adds theirs up: each holds its own copy of the weights. Not counted: a draft model
(--speculative draft) with its KV.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import psutil
import torch

from engine.backends.weight_ops import int4_shapes, int8g_shapes
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kv.cache import bytes_per_block, choose_num_blocks
from engine.model.loader import ModelSource, model_class
from engine.model.quant import HEAD_NAMES, PROJECTIONS, WeightChoice, WeightFormat, choose_weight_dtype

GiB, MiB = float(1 << 30), float(1 << 20)
PROCESS_BYTES = 256 << 20  # per engine: the interpreter with torch and the kernels loaded, before any model
FP32 = 4


class InsufficientMemoryError(ConfigError):
    """The weights, KV pool and activations asked for do not fit in the memory available."""


@dataclass(frozen=True)
class Footprint:
    """Resident bytes by part, of one engine or of several together (`+`)."""

    weights: int = 0  # every copy of the model's weights
    weight_format: str = ""  # "int4", or "int4, LM head bfloat16" where the head keeps another format
    copies: int = 0  # engines holding a copy of the weights
    kv: int = 0  # every KV pool
    packed: int = 0  # the backends' second copies of weights (packed for their kernels), every engine's
    activations: int = 0  # the allowance of every engine

    def __add__(self, other: Footprint) -> Footprint:
        formats = [f for f in dict.fromkeys((self.weight_format, other.weight_format)) if f]
        return Footprint(weights=self.weights + other.weights, weight_format="; ".join(formats),
                         copies=self.copies + other.copies, kv=self.kv + other.kv, packed=self.packed + other.packed,
                         activations=self.activations + other.activations)

    @property
    def total(self) -> int:
        return self.weights + self.packed + self.kv + self.activations

    def describe(self) -> str:
        """'model weights 2 x 1.2 GiB (int4) + KV pool 40.0 GiB + activations 560.0 MiB = 42.9 GiB'."""
        copies = f"{self.copies} x " if self.copies > 1 else ""
        terms = [f"model weights {copies}{_gib(self.weights / max(self.copies, 1))} ({self.weight_format})"]
        terms += [f"packed copies {copies}{_gib(self.packed / max(self.copies, 1))}"] if self.packed else []
        terms += [f"KV pool {_gib(self.kv)}"] if self.kv else []
        terms.append(f"activations {_gib(self.activations)}")
        return f"{' + '.join(terms)} = {_gib(self.total)}"

    def check(self, available: int) -> None:
        """InsufficientMemoryError, one sentence with the numbers and what to change, when it does not fit."""
        if self.total > available:
            raise InsufficientMemoryError(f"{self.describe()}, but only {_gib(available)} is available; "
                                          f"{self._remedy()}")

    def _remedy(self) -> str:
        """The changes that would matter: those on a part of at least a tenth of the total."""
        big = [part * 10 >= self.total for part in (self.kv, self.weights + self.packed)]
        ways = ["lower --kv-cache-memory (or --num-kv-blocks)"] if big[0] else []
        if big[1] and self.weight_format != "int4":
            ways.append("load smaller weights (--weight-dtype int8 or int4)")
        if big[1] and self.copies > 1:
            ways.append("run fewer actors (each holds its own copy of the weights)")
        return ", ".join([*ways, "or free some memory"]) if ways else "free some memory"


def _gib(size: float) -> str:
    """'41.5 GiB'; below one GiB in MiB ('288.0 MiB')."""
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / MiB:.1f} MiB"


# ---------------------------------------------------------------- the parts

def weight_footprint(shapes: Mapping[str, tuple[int, ...]], choice: WeightChoice, dtype: torch.dtype,
                     tied: bool, parameter_name: Callable[[str], str] = str) -> Footprint:
    """One copy of a checkpoint's weights (Hugging Face names -> shapes, from the header) as the model keeps them:
    the layers' projections in their own format (`choice.modules`, by the parameter `parameter_name` says each
    fills) or else `choice.layers`, the LM head's tensor (tied: the embedding table) in `choice.head`, the rest
    (embeddings, norms, biases) in the serving dtype."""
    head = HEAD_NAMES[1] if tied else HEAD_NAMES[0]
    size = 0
    for name, shape in shapes.items():
        if (tied and name == HEAD_NAMES[0]) or name.endswith("rotary_emb.inv_freq"):
            continue  # not loaded: a tied head is the embedding table
        size += tensor_bytes(shape, _format_of(name, head, choice, parameter_name), dtype)
    plain = str(dtype).removeprefix("torch.")
    layer_formats = sorted(set(choice.modules.values()) or {choice.layers})
    layers = "+".join(plain if f == "bfloat16" else f for f in layer_formats)
    lm_head = plain if choice.head == "bfloat16" else choice.head
    label = layers if lm_head == layers else f"{layers}, LM head {lm_head}"
    return Footprint(weights=size, weight_format=label, copies=1)


def _format_of(name: str, head: str, choice: WeightChoice, parameter_name: Callable[[str], str]) -> WeightFormat:
    if name == head:
        return choice.head
    if name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS:
        return choice.modules.get(parameter_name(name), choice.layers)
    return "bfloat16"  # what quant calls the plain format: the serving dtype


def tensor_bytes(shape: tuple[int, ...], fmt: WeightFormat, dtype: torch.dtype) -> int:
    """Bytes of one weight in `fmt` ("bfloat16": plain, in the serving dtype `dtype`)."""
    if fmt == "bfloat16" or len(shape) != 2:
        return math.prod(shape) * dtype.itemsize
    rows, cols = shape
    if fmt == "int8":
        return rows * cols + rows * FP32
    if fmt == "int8g":  # with offsets: the most it takes (types without minimums drop them after the load)
        codes, scales = int8g_shapes(rows, cols, offsets=True)
        return math.prod(codes) + math.prod(scales) * FP32
    codes, scales = int4_shapes(rows, cols)
    return math.prod(codes) + math.prod(scales) * torch.float16.itemsize


# formats whose weights the CPU kernels also hold packed: bf16 blocks (or oneDNN's copy; a gate|up weight's
# interleaved blocks instead), and int8's W8A8 copy where VNNI runs it; int4 is read in its own layout
PACKED_FORMATS: tuple[WeightFormat, ...] = ("bfloat16", "int8")


def packed_footprint(shapes: Mapping[str, tuple[int, ...]], choice: WeightChoice, dtype: torch.dtype, tied: bool,
                     parameter_name: Callable[[str], str] = str,
                     packs: tuple[WeightFormat, ...] = PACKED_FORMATS) -> Footprint:
    """The backend's second copies of a checkpoint's matrices: each projection and the LM head whose format is in
    `packs`, at its own size (the packings pad a little, which this leaves out). An upper bound where the kernels
    decline a packing (no W8A8 without VNNI, no oneDNN copy where torch lacks its bf16 path)."""
    head = HEAD_NAMES[1] if tied else HEAD_NAMES[0]
    size = 0
    for name, shape in shapes.items():
        if len(shape) != 2 or (tied and name == HEAD_NAMES[0]) or name.endswith("rotary_emb.inv_freq"):
            continue
        is_projection = name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in PROJECTIONS
        fmt = _format_of(name, head, choice, parameter_name)
        if (name == head or is_projection) and fmt in packs:
            size += tensor_bytes(shape, fmt, dtype)
    return Footprint(packed=size)


def kv_footprint(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, available: int) -> Footprint:
    """The KV pool the builder allocates for this config with `available` bytes free."""
    try:
        blocks = choose_num_blocks(cfg, config.block_size, dtype, config.num_kv_blocks, config.kv_cache_memory,
                                   available, config.kv_cache_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Footprint(kv=blocks * bytes_per_block(cfg, config.block_size, dtype, config.kv_cache_dtype))


def activation_footprint(cfg: ModelConfig, config: EngineConfig) -> Footprint:
    """An allowance for one engine's step: the hidden states, attention and MLP intermediates of a full token
    budget in fp32, the logits of every running sequence, and the process itself (PROCESS_BYTES)."""
    per_token = 4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    step = config.max_num_batched_tokens * per_token * FP32
    logits = 2 * config.max_num_seqs * cfg.vocab_size * FP32
    return Footprint(activations=step + logits + PROCESS_BYTES)


# ---------------------------------------------------------------- an engine, a layout

def engine_footprint(source: ModelSource, config: EngineConfig, dtype: torch.dtype, available: int,
                     kv_pool: bool = True) -> Footprint:
    """One engine of `config` on `source` with `available` bytes free; `kv_pool` False for an engine that keeps
    no pool of its own (a prefill actor writes into its decode actors')."""
    cfg = source.config
    parameter_name = model_class(cfg).parameter_name
    choice = choose_weight_dtype(config.weight_dtype, source.types, dtype, cfg.tie_word_embeddings, parameter_name,
                                 quiet=True)
    weights = weight_footprint(source.shapes(), choice, dtype, cfg.tie_word_embeddings, parameter_name)
    packs = () if config.enforce_eager or dtype != torch.bfloat16 else PACKED_FORMATS  # the CPU kernels' only
    packed = packed_footprint(source.shapes(), choice, dtype, cfg.tie_word_embeddings, parameter_name, packs)
    kv = kv_footprint(cfg, config, dtype, available) if kv_pool else Footprint()
    return weights + packed + kv + activation_footprint(cfg, config)


def total(parts: Iterable[Footprint]) -> Footprint:
    return sum(parts, Footprint())


def check_resident(footprint: Footprint, available: int, log: logging.Logger, where: str = "") -> None:
    """The start-up line saying what will be resident (`where`: whose, e.g. "by 2 actors"), then
    InsufficientMemoryError when it does not fit in `available`."""
    log.info("resident once loaded%s: %s, of %s available", f" {where}" if where else "", footprint.describe(),
             _gib(available))
    footprint.check(available)


def available_memory() -> int:
    """What the estimates are held against: memory the system can give without swapping."""
    return psutil.virtual_memory().available
