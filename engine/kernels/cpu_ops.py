"""CPU kernels (numba.njit) for the two places where plain torch ops leave most of the machine idle on a
bf16 model: small-batch matrix-vector products and decode attention over paged KV.

- `linear_bf16`: y = x W^T + b for a handful of rows. torch's bf16 GEMM reaches about 8 GB/s of weight
  traffic at one row on a 2-core AVX-512 host (its AMX/oneDNN kernels are built for large batches); this
  kernel streams each weight row once, widening bf16 to fp32 with a shift, at 12-15 GB/s. Accumulation is
  in fp32, as torch's; only the summation order differs.
- `paged_decode_attention_bf16`: one query per sequence attends to its context read in place from the
  pages [num_blocks, block_size, kv_heads, head_dim] through its block table: no gather copy, no padding
  mask, one pass over K (scores, softmax in fp32) and one over V.

bf16 arrays cross into numba as uint16 views (numba has no bf16 type); `_bf16` widens one element exactly.
Compiled on first call and cached on disk (cache=True); `warm_up()` compiles ahead of serving.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import njit, prange

# Inside the model the kernels share the cores with torch's own OpenMP pool (numba brings a second one), which
# eats most of their isolated speed-up: measured on the 2-core host (/tmp-free: bench/offline_throughput.py
# --compare-eager), the GEMV wins at one row and loses at four; the attention kernel wins for one or two
# sequences and loses from eight (where the flat-page gather + SDPA is faster).
MAX_GEMV_ROWS = 1
MAX_ATTENTION_ROWS = 2


@njit(inline="always")
def _bf16(bits: np.uint16) -> np.float32:
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _gemv_bf16(x, w, bias, has_bias, out):  # pragma: no cover - compiled
    # x [M, K] f32, w [N, K] u16 (bf16 bits), bias [N] f32, out [M, N] f32
    n, k = w.shape
    m = x.shape[0]
    for i in prange(n):
        for r in range(m):
            acc = np.float32(0.0)
            for j in range(k):
                acc += _bf16(w[i, j]) * x[r, j]
            out[r, i] = acc + bias[i] if has_bias else acc


@njit(parallel=True, fastmath=True, cache=True, error_model="numpy")
def _decode_attention_bf16(q, k_pages, v_pages, block_tables, context_lens, scale, out):  # pragma: no cover
    # q [B, Hq, D] f32; k/v_pages [N, bs, Hkv, D] u16; block_tables [B, nb] i64; context_lens [B] i64
    # out [B, Hq, D] f32. One task per (sequence, kv head): its query group shares every K/V read.
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // num_kv_heads
    for task in prange(num_seqs * num_kv_heads):
        b = task // num_kv_heads
        h = task % num_kv_heads
        length = context_lens[b]
        scores = np.empty((group, length), np.float32)
        for t in range(length):
            block = block_tables[b, t // block_size]
            slot = t % block_size
            for g in range(group):
                s = np.float32(0.0)
                for d in range(head_dim):
                    s += q[b, h * group + g, d] * _bf16(k_pages[block, slot, h, d])
                scores[g, t] = s * scale
        acc = np.zeros((group, head_dim), np.float32)
        for g in range(group):
            peak = scores[g, 0]
            for t in range(1, length):
                peak = max(peak, scores[g, t])
            total = np.float32(0.0)
            for t in range(length):
                e = np.float32(math.exp(scores[g, t] - peak))
                scores[g, t] = e
                total += e
            scores[g, 0:length] /= total
        for t in range(length):
            block = block_tables[b, t // block_size]
            slot = t % block_size
            for g in range(group):
                p = scores[g, t]
                for d in range(head_dim):
                    acc[g, d] += p * _bf16(v_pages[block, slot, h, d])
        for g in range(group):
            for d in range(head_dim):
                out[b, h * group + g, d] = acc[g, d]


def _u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_bf16` is the faster choice for this product."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS and weight.is_contiguous())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] -> [M, N] bf16, rounded once from fp32."""
    x32 = x.float().contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    b32 = bias.float() if bias is not None else torch.empty(weight.shape[0])
    _gemv_bf16(x32.numpy(), _u16(weight), b32.numpy(), bias is not None, out.numpy())
    return out.to(torch.bfloat16)


def decode_attention_bf16(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; pages [num_blocks, bs, Hkv, D] bf16; block_tables [B, nb] int64 (entries past a
    sequence's context are never read); context_lens [B] int64 (>= 1) -> [B, Hq, D] bf16."""
    out = torch.empty(q.shape, dtype=torch.float32)
    _decode_attention_bf16(q.float().numpy(), _u16(k_pages), _u16(v_pages), block_tables.numpy(),
                           context_lens.numpy(), np.float32(scale), out.numpy())
    return out.to(torch.bfloat16)


def set_threads(num_threads: int) -> None:
    """Numba's pool size for these kernels (an actor gets a share of the cores, as torch does)."""
    numba.set_num_threads(max(1, min(num_threads, numba.config.NUMBA_NUM_THREADS)))


def warm_up() -> None:
    """Compile (or load from the disk cache) both kernels on tiny inputs."""
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    linear_bf16(torch.zeros(1, 16, dtype=torch.bfloat16), w, torch.zeros(4, dtype=torch.bfloat16))
    pages = torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16)
    decode_attention_bf16(torch.zeros(1, 2, 16, dtype=torch.bfloat16), pages, pages,
                          torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)
