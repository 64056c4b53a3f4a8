"""The hardware operations the model asks for, behind one object chosen once per engine (engine/backends/select.py).

The model (engine/model/llama.py) and paged attention (engine/backends/attention.py) call these and nothing else that
depends on the device or the CPU. The hooks that may decline (`decode_attention`, `fresh_attention`,
`decode_layers`, `greedy_tokens`) return None where this backend has nothing better than the plain torch path
their caller runs.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.backends.attention import AttentionMetadata
    from engine.model.llama import LlamaModel

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]


class Backend(ABC):
    name: str
    attends_in_place = False  # decode attention reads the pages in place: no gather per row (engine/core/runner.py)

    @abstractmethod
    def prepare(self, model: LlamaModel) -> None:
        """Make what this backend needs of the loaded weights (packed copies, the decode stack), once."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias), on `packed` (the weight's copy made by `prepare`) where that is faster."""

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
    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                     fused: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of the MLP's gate|up product x W^T; `fused`: the interleaved copy made by `prepare`."""

    def linear_int8(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x (codes * scale)^T + bias for an int8 weight with per-output-channel scales (engine/model/quant.py);
        here by F.linear on the weight dequantised to x's dtype."""
        from engine.model.quant import linear_int8

        return linear_int8(x, codes, scale, bias)

    def linear_int4(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias for an int4 weight (engine/model/quant.py: pack_int4's codes, fp16 scales and offsets
        [2, G, N]); here by F.linear on chunks of the weight dequantised to x's dtype."""
        from engine.model.quant import linear_int4

        return linear_int4(x, packed, scales, bias)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                packed: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's product x W^T [B, V] in fp32 (a float weight, or int8 / int4 with `scale`; `packed`: its
        copy made by `prepare`). Rounded to bf16, close logits tie (the steps are 0.125 between 16 and 32) and the
        argmax picks the lower id. Here by F.linear in fp32 on chunks of the weight widened to fp32."""
        from engine.model.quant import linear_fp32

        return linear_fp32(x, weight, scale)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @abstractmethod
    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64, logits.max(dim=-1).indices."""

    def decode_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, meta: AttentionMetadata,
                         scale: float) -> torch.Tensor | None:
        return None

    def fresh_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int,
                        scale: float) -> torch.Tensor | None:
        return None

    def decode_layers(self, model: LlamaModel, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                      kv_caches: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step's layers in one call -> (last layer's output, residual stream)."""
        return None

    def greedy_tokens(self, model: LlamaModel, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of the LM head's product, without the [B, V] logits."""
        return None

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """backend, matrix_engine ("tiles", "vectors" or None), kernels (in use), build_key (or None)."""
