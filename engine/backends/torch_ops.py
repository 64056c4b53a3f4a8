"""Plain torch ops: --enforce-eager, dtypes without kernels (fp32, fp16) and devices other than the CPU."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from engine.backends.base import Backend, Rope
from engine.model.rope import apply_rotary

if TYPE_CHECKING:
    from engine.model.llama import LlamaModel


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, model: LlamaModel) -> None:
        model.clear_prepared()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary(self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        return apply_rotary(q, *rope), apply_rotary(k, *rope), v

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                     fused: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.linear(x, weight, None, packed).chunk(2, dim=-1)
        return F.silu(gate) * up

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.max(dim=-1).indices

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": str(self.device), "matrix_engine": None, "kernels": [],
                "build_key": None}


def split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused q|k|v output [T, *] -> views q [T, Hq, D], k and v [T, Hkv, D]."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)
