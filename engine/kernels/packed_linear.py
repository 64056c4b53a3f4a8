"""bf16 weights packed once at start-up, for decode-sized products and prefill chunks.

Two packings; engine/backends/cpu_kernels.py picks one per weight and the row counts each serves:
- 16x16-pair blocks (`cpu_ext.tile_pack`, 4-D) for tiled_linear.cpp, on AMX tiles or AVX-512 BF16 vectors. It
  streams the weights once and prefetches ahead, where oneDNN's packed matmul re-reads them.
- oneDNN's own packed copy (2-D): F.linear hands oneDNN a plain [N, K] weight, which its matmul re-blocks on every
  call; a copy packed once skips that, bit-identical to F.linear.
An MLP's gate|up weight is packed with its 16-row blocks interleaved (`pack_gate_up`), so that SiLU * up is
computed as the product's results come out. Figures: docs/performance.md (`python -m bench.tiled_linear`).
"""
from __future__ import annotations

import functools
import logging

import torch

from engine.kernels import cpu_ext

log = logging.getLogger(__name__)


@functools.cache
def onednn_available() -> bool:
    """Whether this torch packs bf16 weights for oneDNN here: x86 builds with oneDNN, on a CPU whose bf16 path it
    has (AVX-512 or AVX-NE-CONVERT; an AVX2-only CPU refuses every weight). Probed once on a small weight."""
    try:
        if not (torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)):
            return False
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 1)
        return True
    except (AttributeError, RuntimeError):
        return False


def blocks_fit(weight: torch.Tensor) -> bool:
    """Whether `cpu_ext.tile_pack` takes this weight's shape."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    return cpu_ext.tile_pack(weight.detach())


def pack_onednn(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """weight [N, K] bf16 -> oneDNN's packed copy (blocked for `batch_hint` rows), or None where it does not pack."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
    except RuntimeError as exc:  # an ISA or shape oneDNN does not pack: plain F.linear serves
        log.warning("could not pack a %s weight for oneDNN (%s); using F.linear", tuple(weight.shape), exc)
        return None


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor | None:
    """An MLP's gate|up weight [2I, K] bf16 (gate rows, then up rows) -> packed blocks of it with its 16-row blocks
    interleaved (gate block j, then up block j), for cpu_ext.tiled_linear_silu_mul; None where the weight is not
    bf16, or I not a multiple of 16, or K not of 32."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % 32 or not blocks_fit(weight):
        return None
    rows, k = weight.shape
    interleaved = weight.detach().reshape(2, rows // 32, 16, k).transpose(0, 1).reshape(rows, k)
    return cpu_ext.tile_pack(interleaved.contiguous())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16, packed by `pack_onednn` -> [M, N] bf16, F.linear(x, weight, bias) to the bit."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
