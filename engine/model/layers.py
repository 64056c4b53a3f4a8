"""What every architecture's model file builds on: the Linear wrappers and RMSNorm, whose products and norms the
backend runs, and the preparation step that turns a loaded model's weights into a backend's layout.

`prepare_weights(model, backend)` asks the backend for each Linear's `Weight` (engine/backends/weight_ops.py: the
tensors and the backend's copies of them) and for the LM head's, and, where the model describes its layers as a
fused decode step can run them (`decode_stack_spec`), for that step; it keeps them in a `PreparedWeights` table
keyed by the Linear modules, beside the model, never on its modules. A model's forward passes that table down,
and each Linear asks it for its product: a new architecture gets the backend's kernels by using these wrappers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from engine.backends.attention import AttentionMetadata
from engine.backends.base import Backend, Rope, StackLayer, StackShape
from engine.backends.weight_ops import Weight


class Linear(nn.Linear):
    """nn.Linear whose product the backend runs, on its prepared Weight; with `weight_scale` the weight is int8
    codes with per-output-channel scales, or int4 codes with group scales (engine/model/quant.py)."""

    # [out_features] fp32 where the weight is int8; [2, groups, out_features] fp16 where it is int4
    weight_scale: torch.Tensor | None = None

    def prepare(self, backend: Backend) -> Weight:
        return backend.prepare_linear(self.weight, self.bias, self.weight_scale)

    def forward(self, x: torch.Tensor, prepared: PreparedWeights) -> torch.Tensor:
        return prepared.backend.linear(x, prepared.linears[self])


class SiluGateUp(Linear):
    """An MLP's fused gate|up projection (gate rows, then up rows) -> silu(gate) * up, which the backend may run
    as one product."""

    def prepare(self, backend: Backend) -> Weight:
        return backend.prepare_gate_up(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor, prepared: PreparedWeights) -> torch.Tensor:
        return prepared.backend.gate_up_silu(x, prepared.linears[self])


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementation does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, prepared: PreparedWeights) -> torch.Tensor:
        return prepared.backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    prepared: PreparedWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add, fused into the norm where the backend can."""
        return prepared.backend.add_rms_norm(x, residual, self.weight, self.eps)


class PreparableModel(Protocol):
    """What prepare_weights reads of a model."""

    @property
    def dtype(self) -> torch.dtype: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def head_module(self) -> nn.Module:
        """The module whose `weight` (and `weight_scale` where quantised) is the LM head's."""

    def decode_stack_spec(self, linears: Mapping[nn.Module, Weight]) -> tuple[Sequence[StackLayer],
                                                                               StackShape] | None:
        """Its layers as a fused decode step computes them (Backend.decode_stack), or None where they differ."""


@dataclass(frozen=True, eq=False)
class PreparedWeights:
    """A model's weights in one backend's layout: each Linear's Weight, the LM head's, and the fused decode step's
    state (None where the backend or the model has none)."""

    backend: Backend
    linears: Mapping[nn.Module, Weight]
    head: Weight
    stack: object | None = None

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.backend.lm_head(hidden, self.head)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.backend.greedy_tokens(hidden, self.head)

    def decode_layers(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv_caches: list,
                      window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.stack is None:
            return None
        return self.backend.decode_layers(self.stack, x, rope, meta, kv_caches, window)


def prepare_weights(model: PreparableModel, backend: Backend) -> PreparedWeights:
    """The model's weights as `backend` runs them (packed copies, the decode stack), made once; call it after the
    weights are loaded."""
    backend.check_dtype(model.dtype)
    linears = {module: module.prepare(backend) for module in model.modules() if isinstance(module, Linear)}
    head = model.head_module()
    head_weight = backend.prepare_linear(head.weight, None, getattr(head, "weight_scale", None))
    spec = model.decode_stack_spec(linears)
    stack = None if spec is None else backend.decode_stack(*spec)
    return PreparedWeights(backend, linears, head_weight, stack)
