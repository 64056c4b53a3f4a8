"""Plain torch ops: --enforce-eager, dtypes without kernels (fp32, fp16) and devices other than the CPU."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.backends.base import Backend, Rope
from engine.backends.weight_ops import Weight


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def linear_float(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return F.linear(x, w.data, w.bias)

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

    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        gate, up = self.linear(x, w).chunk(2, dim=-1)
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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated pairwise in the half-split layout (x[..., :D/2] pairs with x[..., D/2:])."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
