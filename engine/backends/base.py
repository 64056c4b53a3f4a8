"""The hardware operations a model asks for, behind one object chosen once per engine (engine/backends/select.py).

A backend knows tensors and weight formats (engine/backends/weight_ops.py), never a model: a model's weights reach it
one product at a time (`prepare_linear`, `prepare_gate_up`, once, giving back the `Weight` it runs on) and, for
the fused decode step, as a list of per-layer weights (`decode_stack`). The preparation step that walks a model
(engine/model/layers.py `prepare_weights`) and paged attention (engine/backends/attention.py) call these and
nothing else that depends on the device or the CPU. The hooks that may decline (`write_kv`, `decode_attention`,
`fresh_attention`, `prefill_attention`, `decode_stack`, `decode_layers`, `greedy_tokens`) return None (or False)
where this backend has nothing better than the plain torch path their caller runs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from engine.backends import weight_ops
from engine.backends.weight_ops import Weight

if TYPE_CHECKING:
    from engine.backends.attention import AttentionMetadata

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]


@dataclass(frozen=True, eq=False)
class StackLayer:
    """One decoder layer's weights for the fused decode step, which computes Llama's layer: RMSNorm, q|k|v (with
    q_norm / k_norm: one RMSNorm over head_dim shared by every q head, and one by every k head), RoPE, paged
    attention, o, the residual add in RMSNorm, silu(gate) * up, down."""

    input_norm: torch.Tensor
    qkv: Weight
    o: Weight
    post_attention_norm: torch.Tensor
    gate_up: Weight
    down: Weight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class StackShape:
    """What every layer of a fused decode step shares."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float  # the RMSNorms'
    scale: float  # the attention scores'


class Backend(ABC):
    name: str
    attends_in_place = False  # decode attention reads the pages in place: no gather per row (engine/core/runner.py)
    # a decode-only step on plain pages runs without a host sync and with launch shapes fixed by its row count,
    # so it can be captured as a CUDA graph and replayed (engine/core/cuda_graphs.py)
    captures_decode = False

    # ---- preparation: once per model, the weights in this backend's layout -----------------------------------

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raises ValueError where this backend cannot run a model whose activations are `dtype`."""

    def prepare_linear(self, data: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None) -> Weight:
        """A product's weight (float, or int8 / int4 codes with `scale`) -> the Weight `linear` and `lm_head` take,
        with whatever copies of it this backend runs faster on (none here)."""
        return Weight(data, bias=bias, scale=scale)

    def prepare_gate_up(self, data: torch.Tensor, scale: torch.Tensor | None) -> Weight:
        """An MLP's gate|up weight (gate rows, then up rows) whose product `gate_up_silu` takes."""
        return self.prepare_linear(data, None, scale)

    def decode_stack(self, layers: Sequence[StackLayer], shape: StackShape) -> object | None:
        """The decoder layers as one call for `decode_layers`, or None where this backend has none."""
        return None

    # ---- the operations -------------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x W^T + bias in x's dtype, for a weight in any format."""
        if w.scale is None:
            return self.linear_float(x, w)
        if weight_ops.is_int4(w.data):
            return self.linear_int4(x, w)
        return self.linear_int8g(x, w) if weight_ops.is_int8g(w.data, w.scale) else self.linear_int8(x, w)

    @abstractmethod
    def linear_float(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """F.linear(x, w.data, w.bias), on the backend's copy where that is faster."""

    def linear_int8(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x (codes * scale)^T + bias for an int8 weight with per-output-channel scales; here by F.linear on the
        weight dequantised to x's dtype."""
        return weight_ops.linear_int8(x, w.data, w.scale, w.bias)

    def linear_int4(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x W^T + bias for an int4 weight (codes, fp16 scales and offsets in int4_shapes' layouts); here by
        F.linear on chunks of the weight dequantised to x's dtype."""
        return weight_ops.linear_int4(x, w.data, w.scale, w.bias)

    def linear_int8g(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x W^T + bias for an int8g weight (int8 codes, fp32 scales and offsets per 16 or 32 values); here by F.linear
        on chunks of the weight dequantised to x's dtype."""
        return weight_ops.linear_int8g(x, w.data, w.scale, w.bias)

    def lm_head(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The LM head's product x W^T [B, V] in fp32 (a float, int8 or int4 weight). Rounded to bf16, close logits
        tie (the steps are 0.125 between 16 and 32) and the argmax picks the lower id. Here by F.linear in fp32 on
        chunks of the weight widened to fp32."""
        return weight_ops.linear_fp32(x, w.data, w.scale)

    @abstractmethod
    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """silu(gate) * up [T, I] of the MLP's gate|up product x W^T [T, 2I] (a Weight from `prepare_gate_up`)."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""

    @abstractmethod
    def rotary(self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused q|k|v output [T, *] -> q [T, Hq, D], k [T, Hkv, D] rotated, v [T, Hkv, D]."""

    @abstractmethod
    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64, logits.max(dim=-1).indices."""

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        """`fn` (pure tensor work, e.g. the sampler's dense_distribution) compiled into fused kernels on first
        call, or None where this backend runs such work as plain torch ops (the caller keeps its own path)."""
        return None

    def write_kv(self, cache: object, x: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """New tokens' keys or values x [T, Hkv, D] into their slots of one layer's pages; False: declined (the
        caller's index_copy_ or page write serves)."""
        return False

    def decode_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, meta: AttentionMetadata,
                         scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
        """The decode group's attention [D, Hq, hd], read from the pages in place; `window` and `softcap` as
        engine/backends/attention.py paged_attention takes them."""
        return None

    def fresh_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
        """`count` whole prompts of one length attending causally to themselves."""
        return None

    def extend_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int,
                         scale: float, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor | None:
        """A chunk of S queries after `context` cached tokens: q [S, Hq, hd], keys / values [context + S, Hkv, hd]
        (the prefix's and the chunk's, gathered from the pages) -> [S, Hq, hd], query i attending causally to keys
        [0, context + i]; None: declined."""
        return None

    def paged_extend_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, block_table: torch.Tensor,
                               context: int, scale: float, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor | None:
        """As extend_attention, the keys and values read in place from the pages through the chunk's block table
        (its own already written there); None: declined, and the keys are gathered for extend_attention."""
        return None

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: object,
                          v_cache: object, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                          window: int | None = None, softcap: float | None = None) -> bool:
        """Every prefill segment of the step (rows meta.num_decode onwards, their keys already written) into the
        same rows of `out`, each attending to its cached prefix and itself; False: declined."""
        return False

    def decode_layers(self, stack: object | None, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                      kv_caches: list, window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step's layers on `stack` (from `decode_stack`; None: declined) in one call -> (last layer's
        output, residual stream). `window`: the layers' sliding window, where they have one."""
        return None

    def greedy_tokens(self, hidden: torch.Tensor, head: Weight) -> torch.Tensor | None:
        """Each row's argmax of the LM head's product, without the [B, V] logits."""
        return None

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """backend, matrix_engine ("tiles", "vectors" or None), kernels (in use), build_key (or None)."""
