"""bf16 linear layers on weights packed once at start-up, for decode-sized products and prefill chunks.

Two packings, the first that applies:
- 16x16-pair blocks for our kernel (engine/kernels/tiled_linear.cpp, `cpu_ext.tiled_linear`), on CPUs with AMX
  (the blocks are its B tiles) or AVX-512 BF16 (the vector engine reads the same blocks).
- oneDNN's own packed copy (torch's mkldnn ops). F.linear hands oneDNN a plain [N, K] weight, which its AMX /
  AVX-512 matmul re-blocks on every call; a copy packed once skips that. Measured on this 2-core host
  (2 threads, ms per call, SmolLM2 shapes, F.linear -> oneDNN packed; outputs bit-identical up to 128 rows):
      rows      qkv 576x960     gate_up 576x3072   down 1536x576   lm_head 576x49152
        8       0.081 -> 0.048   0.238 -> 0.167     0.103 -> 0.062   2.57 -> 1.58
       64       0.156 -> 0.126   0.506 -> 0.393     0.238 -> 0.174   5.38 -> 2.70
      128       0.238 -> 0.203   0.713 -> 0.562     0.388 -> 0.294   8.50 -> 5.58
      512       0.762 -> 0.709   2.268 -> 2.092     1.134 -> 1.890  40.8  -> 59.5
- The tiles (AMX) against oneDNN's packed copy: all 121 products of a SmolLM2 decode step (269 MB), caches
  flushed, medians of 4 alternated passes (`python -m bench.tiled_linear`), ms oneDNN -> tiles: 2 rows 15.8 ->
  13.1, 8 rows 15.0 -> 13.6, 32 rows 20.1 -> 12.7, 64 rows 24.4 -> 17.3, 128 rows 30.0 -> 25.8 (a plain sum
  over the same weights: 18.9). In the engine (same command): batch 32 669 -> 847 tok/s, batch 64 955 -> 967.
  Both sum in fp32 and round once; results differ from oneDNN's by the order of the sums (a bf16 ulp, rarely).
- The vectors (AVX-512 BF16) on a 2-core AMD EPYC (Zen 5), where oneDNN's packed copy was the only packing
  before: the 120 layer products of a SmolLM2 forward (30 x qkv, o, gate_up, down; weights from memory), 2
  threads, medians of 12 alternated passes (session 12, a throwaway copy of this kernel), ms F.linear / oneDNN
  packed / vectors: 8 rows 10.6 / 7.65 / 6.39, 16 rows 12.2 / 9.18 / 6.55, 32 rows 16.1 / 12.7 / 10.0, 64 rows
  24.1 / 20.2 / 15.9 (860 GFLOPS), 128 rows 37.0 / 33.1 / 28.7, 256 rows 72.5 / 60.0 / 54.6, 512 rows 132 / 115
  / 110, 1024 rows 266 / 229 / 225, 2048 rows 519 / 449 / 451 (965 GFLOPS). The shipped kernel, `python -m
  bench.tiled_linear` (7 rounds): decode step (121 products, caches flushed) oneDNN packed -> vectors 24.8 ->
  20.6 ms at 64 rows, 1.08-1.29x at 2-128 rows; prefill products 1.03-1.07x F.linear at 512-2048 rows. The
  vectors serve every row count from 2 there, up to 4096.
One row goes to our GEMV (cpu_ext, 10-30% faster there), prefill chunks to F.linear on the plain weight, which
is kept (the embedding shares it, and so does the GEMV). A third copy packed by oneDNN for prefill would not pay:
at 2048 rows (a full offline step) it ran each SmolLM2 product within 2% of F.linear, and bit-identical (session
9, 15 alternated calls a shape). At 200 rows it was 17-27% faster; at 512 rows it was 0.65x on o_proj and down.
With either engine, an MLP's gate|up weight is packed instead with its blocks interleaved (`pack_gate_up`), and its
product with SiLU * up is one call at every row count from 2 (the prefill steps above 1024 rows included). On the
tiles, the two passes it replaces took 1.1-2.4x its time at 64-512 rows; at 2048, F.linear's took 0.92-0.95x from
memory and 1.11-1.13x in cache, and whole offline prefills ran 1.03-1.09x faster with it (figures in
engine/kernels/tiled_linear.cpp).
"""
from __future__ import annotations

import functools
import logging

import torch

from engine.kernels import cpu_ext

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 64  # the row count oneDNN picks its blocking for
MAX_PACKED_ROWS = 128  # oneDNN's packed copy: 2..this many rows
# The packed blocks serve 2..this many rows, by engine (cpu_ext.matrix_engines); F.linear above. Tiles: prefill
# chunks of the server's 512-token steps among them; the 2048-token offline steps keep F.linear (figures in
# engine/kernels/tiled_linear.cpp). Vectors: every step up to 4096 tokens (measured faster up to 2048: figures above;
# A is sliced by rows, so larger steps scale as 2048 does).
ENGINE_MAX_TILED_ROWS = {"tiles": 1024, "vectors": 4096}
MAX_TILED_ROWS: int | None = None  # set: this limit on any engine (tests, comparisons)
TILED_PACKING = True  # off: oneDNN's packed copy even where the packed blocks would run (for comparisons)
FUSED_GATE_UP = True  # off: the MLP's gate|up product packed and run like the others, SiLU * up a pass of its own


@functools.cache
def available() -> bool:
    """Whether this torch has the mkldnn packing ops (x86 builds with oneDNN)."""
    try:
        return torch.backends.mkldnn.is_available() and callable(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def tiled_applies(weight: torch.Tensor) -> bool:
    return (TILED_PACKING and weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and cpu_ext.tiled_available())


def max_tiled_rows() -> int:
    """The most rows a product on the packed blocks takes here (0 where no engine runs them)."""
    if MAX_TILED_ROWS is not None:
        return MAX_TILED_ROWS
    engines = cpu_ext.matrix_engines()
    return ENGINE_MAX_TILED_ROWS[engines[0]] if engines else 0


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 on the CPU -> its packed copy (16x16-pair blocks: 4-D; oneDNN: 2-D), or None where
    packing does not apply."""
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2:
        return None
    if tiled_applies(weight):
        return cpu_ext.tile_pack(weight.detach())
    if not available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
    except RuntimeError as exc:  # an ISA or shape oneDNN does not pack: plain F.linear serves
        log.warning("could not pack a %s weight for oneDNN (%s); using F.linear", tuple(weight.shape), exc)
        return None


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor | None:
    """An MLP's gate|up weight [2I, K] bf16 (gate rows, then up rows) -> packed blocks of it with its 16-row blocks
    interleaved (gate block j, then up block j), for cpu_ext.tiled_linear_silu_mul; None where that does not
    apply (no engine here, FUSED_GATE_UP off, I not a multiple of 16)."""
    if (not FUSED_GATE_UP or weight.dtype != torch.bfloat16 or not weight.is_cpu or weight.dim() != 2
            or weight.shape[0] % 32 or not tiled_applies(weight)):
        return None
    rows, k = weight.shape
    interleaved = weight.detach().reshape(2, rows // 32, 16, k).transpose(0, 1).reshape(rows, k)
    return cpu_ext.tile_pack(interleaved.contiguous())


def gate_up_applies(x: torch.Tensor) -> bool:
    """Whether a product on pack_gate_up's copy takes x: bf16 [M, K] with at least 2 rows (one row: the GEMV),
    the fused elementwise kernels on (cpu_ext.FUSED_ELEMENTWISE: off, SiLU * up are torch ops after the plain
    product)."""
    return cpu_ext.FUSED_ELEMENTWISE and x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[0] >= 2


def max_rows(packed: torch.Tensor) -> int:
    """The most rows a product on this packed copy (from `pack`) takes."""
    return max_tiled_rows() if packed.dim() == 4 else MAX_PACKED_ROWS


def applies(x: torch.Tensor, packed: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype == torch.bfloat16 and 2 <= x.shape[0] <= max_rows(packed)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16, packed (from `pack`) -> [M, N] bf16, as F.linear(x, weight, bias)."""
    if packed.dim() == 4:
        return cpu_ext.tiled_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
