"""bf16 linear layers on weights packed once at start-up, for decode-sized products and (AMX) prefill chunks.

Two packings, the first that applies:
- AMX tiles for our kernel (engine/kernels/amx_linear.cpp, `cpu_ext.amx_linear`), on CPUs with AMX.
- oneDNN's own packed copy (torch's mkldnn ops). F.linear hands oneDNN a plain [N, K] weight, which its AMX /
  AVX-512 matmul re-blocks on every call; a copy packed once skips that. Measured on this 2-core host
  (2 threads, ms per call, SmolLM2 shapes, F.linear -> oneDNN packed; outputs bit-identical up to 128 rows):
      rows      qkv 576x960     gate_up 576x3072   down 1536x576   lm_head 576x49152
        8       0.081 -> 0.048   0.238 -> 0.167     0.103 -> 0.062   2.57 -> 1.58
       64       0.156 -> 0.126   0.506 -> 0.393     0.238 -> 0.174   5.38 -> 2.70
      128       0.238 -> 0.203   0.713 -> 0.562     0.388 -> 0.294   8.50 -> 5.58
      512       0.762 -> 0.709   2.268 -> 2.092     1.134 -> 1.890  40.8  -> 59.5
- The AMX kernel against oneDNN's packed copy: all 121 products of a SmolLM2 decode step (269 MB), caches
  flushed, medians of 4 alternated passes (`python -m bench.amx_linear`), ms oneDNN -> AMX: 2 rows 15.8 ->
  13.1, 8 rows 15.0 -> 13.6, 32 rows 20.1 -> 12.7, 64 rows 24.4 -> 17.3, 128 rows 30.0 -> 25.8 (a plain sum
  over the same weights: 18.9). In the engine (same command): batch 32 669 -> 847 tok/s, batch 64 955 -> 967.
  Both sum in fp32 and round once; results differ from oneDNN's by the order of the sums (a bf16 ulp, rarely).
One row goes to our GEMV (cpu_ext, 10-30% faster there), prefill chunks to F.linear on the plain weight, which
is kept (the embedding shares it, and so does the GEMV). A third copy packed by oneDNN for prefill would not pay:
at 2048 rows (a full offline step) it ran each SmolLM2 product within 2% of F.linear, and bit-identical (session
9, 15 alternated calls a shape). At 200 rows it was 17-27% faster; at 512 rows it was 0.65x on o_proj and down.
With AMX, an MLP's gate|up weight is packed instead with its blocks interleaved (`pack_gate_up`), and its product
with SiLU * up is one call at every row count from 2 (the prefill steps above 1024 rows included). The two passes
it replaces took 1.1-2.4x its time at 64-512 rows; at 2048, F.linear's took 0.92-0.95x from memory and 1.11-1.13x
in cache, and whole offline prefills ran 1.03-1.09x faster with it (figures in engine/kernels/amx_linear.cpp).
"""
from __future__ import annotations

import functools
import logging

import torch

from engine.kernels import cpu_ext

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 64  # the row count oneDNN picks its blocking for
MAX_PACKED_ROWS = 128  # oneDNN's packed copy: 2..this many rows
# AMX tiles: 2..this many rows, prefill chunks of the server's 512-token steps among them; the 2048-token offline
# steps keep F.linear (figures in engine/kernels/amx_linear.cpp)
MAX_AMX_ROWS = 1024
AMX_PACKING = True  # off: oneDNN's packed copy even where the AMX kernel runs (for comparisons)
FUSED_GATE_UP = True  # off: the MLP's gate|up product packed and run like the others, SiLU * up a pass of its own


@functools.cache
def available() -> bool:
    """Whether this torch has the mkldnn packing ops (x86 builds with oneDNN)."""
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def amx_applies(weight: torch.Tensor) -> bool:
    return (AMX_PACKING and weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and cpu_ext.amx_available())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 on the CPU -> its packed copy (AMX tiles: 4-D; oneDNN: 2-D), or None where packing
    does not apply."""
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return None
    if amx_applies(weight):
        return cpu_ext.amx_pack(weight.detach())
    if not available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except RuntimeError as exc:  # an ISA or shape oneDNN does not pack: plain F.linear serves
        log.warning("could not pack a %s weight for oneDNN (%s); using F.linear", tuple(weight.shape), exc)
        return None


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor | None:
    """An MLP's gate|up weight [2I, K] bf16 (gate rows, then up rows) -> AMX tiles of it with its 16-row blocks
    interleaved (gate block j, then up block j), for cpu_ext.amx_linear_silu_mul; None where that does not apply
    (no AMX here, FUSED_GATE_UP off, I not a multiple of 16)."""
    if (not FUSED_GATE_UP or weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2
            or weight.shape[0] % 32 or not amx_applies(weight)):
        return None
    rows, k = weight.shape
    interleaved = weight.detach().reshape(2, rows // 32, 16, k).transpose(0, 1).reshape(rows, k)
    return cpu_ext.amx_pack(interleaved.contiguous())


def gate_up_applies(x: torch.Tensor) -> bool:
    """Whether a product on pack_gate_up's copy takes x: bf16 [M, K] with at least 2 rows (one row: the GEMV),
    the fused elementwise kernels on (cpu_ext.FUSED_ELEMENTWISE: off, SiLU * up are torch ops after the plain
    product)."""
    return cpu_ext.FUSED_ELEMENTWISE and x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[0] >= 2


def max_rows(packed: torch.Tensor) -> int:
    """The most rows a product on this packed copy (from `pack`) takes."""
    return MAX_AMX_ROWS if packed.dim() == 4 else MAX_PACKED_ROWS


def applies(x: torch.Tensor, packed: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype == torch.bfloat16 and 2 <= x.shape[0] <= max_rows(packed)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16, packed (from `pack`) -> [M, N] bf16, as F.linear(x, weight, bias)."""
    if packed.dim() == 4:
        return cpu_ext.amx_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
