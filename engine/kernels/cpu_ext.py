"""CPU kernels (C++, engine/kernels/cpu_ext.cpp) for the two places where plain torch ops leave most of the
machine idle on a bf16 model: small-batch matrix-vector products and decode attention over paged KV.

- `linear_bf16`: y = x W^T + b for a few rows. torch's bf16 GEMM reaches about 8 GB/s of weight traffic at
  one row on a 2-core AVX-512 host (its oneDNN kernels are built for large batches); this kernel streams
  each weight row once, widening bf16 to fp32 with a shift. Accumulation is fp32, as torch's; only the
  summation order differs.
- `decode_attention_bf16`: one query per sequence attends to its context read in place from the pages
  [num_blocks, block_size, kv_heads, head_dim] through its block table: no gather copy, no padding mask.

Both run on torch's intra-op thread pool (at::parallel_for). A first version in Numba lost most of its
isolated speed-up inside the model: Numba brings its own OpenMP runtime, whose threads and torch's took
turns on the same two cores. The extension is compiled on first use (torch cpp_extension, cached under
TORCH_EXTENSIONS_DIR, ~1 minute once per machine); without a compiler the engine runs plain torch ops.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ext.cpp")
# Where the kernels measured faster than torch inside the SmolLM2 forward (python -m bench.cpu_kernels,
# 2 cores): rows of a product, sequences of a decode group.
# Measured (min of 10 forwards, ctx 192 / 1024): at one row torch 52.0 / 57.8 ms, GEMV 37.8 / 43.3; at 4-5 rows
# (a verification chunk of 1 + K=4 drafts) the GEMV still wins by 5-10% (each weight vector is widened once
# for all rows); at 8 it breaks even. The attention kernel wins for one sequence and loses from two (torch's
# flash SDPA over the flat-page gather is better vectorised across a batch). Noisy host: the ratios held
# across runs, the absolute times did not.
MAX_GEMV_ROWS = 5
MAX_ATTENTION_SEQS = 1  # sequences in a decode group (a verified sequence brings 1 + K rows)


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, built once per process (and once per machine on disk); None if it cannot be."""
    from torch.utils.cpp_extension import load

    log.info("loading the CPU kernels (built once per machine: about a minute the first time)")
    try:
        # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels ran on one thread. The
        # extension then binds to the libgomp torch already loaded (same soname): one pool for both.
        return load(name="phase_serve_cpu_ext", sources=[str(SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back to torch ops
        log.warning("CPU kernels unavailable (%s); running plain torch ops", str(exc).splitlines()[0][:200])
        return None


def available() -> bool:
    return extension() is not None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_bf16` is the faster choice for this product."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS and weight.is_contiguous())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] -> [M, N] bf16, rounded once from fp32."""
    return extension().linear_bf16(x, weight, bias if bias is not None else torch.empty(0))


def decode_attention_bf16(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; pages [num_blocks, bs, Hkv, D] bf16; block_tables [B, nb] int64 (entries past a
    sequence's context are never read); context_lens [B] int64 (>= 1) -> [B, Hq, D] bf16."""
    return extension().decode_attention_bf16(q, k_pages, v_pages, block_tables, context_lens, scale)


def main() -> int:
    """Build (or load) the extension and report; exit status 1 when it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return 0 if available() else 1
