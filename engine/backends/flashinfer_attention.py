"""FlashInfer's paged decode kernel behind the GPU backend's decode hook (--gpu-attention flashinfer).

FlashInfer takes a batch's pages as CSR: `indptr` [B + 1] (each row's first entry in `indices`), `indices` (the
block ids, row after row) and `last_page_len` [B] (tokens in each row's last block, 1..block_size); `paged_csr`
builds them from the decode group's padded block tables and lengths. Its pages are NHD, [blocks, block_size,
kv_heads, head_dim], the pool's plain layout, so they are read in place. A plan is made once a step for each
(window, soft-cap, scale) the layers use, and shared by the layers that use it. A window W (keys p - W < j <= p)
is FlashInfer's window_left W - 1 (keys p - window_left <= j <= p). The plan runs on the host every step, so a
step on FlashInfer is never captured as a CUDA graph.
"""
from __future__ import annotations

from types import ModuleType

import torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's example size for its split-K scratch


def paged_csr(block_tables: torch.Tensor, context_lens: torch.Tensor,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B + 1], indices, last_page_len [B]) int32 of each row's first ceil(len / block_size) blocks."""
    used = (context_lens + block_size - 1) // block_size  # [B]
    keep = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < used[:, None]
    indptr = torch.zeros(len(used) + 1, dtype=torch.int32, device=used.device)
    indptr[1:] = torch.cumsum(used, 0)
    last = context_lens - (used - 1) * block_size
    return indptr, block_tables[keep].to(torch.int32), last.to(torch.int32)


class FlashInferDecode:
    """One FlashInfer decode wrapper per (window, soft-cap, scale), planned once a step."""

    def __init__(self, flashinfer: ModuleType, device: torch.device) -> None:
        self.flashinfer = flashinfer
        self.device = device
        self.workspace: torch.Tensor | None = None  # allocated on first use: building a backend touches no GPU
        self.wrappers: dict[tuple, object] = {}

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, planned: dict, scale: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D]; `planned`: the step's record of the plans made (AttentionMetadata's
        kernel_inputs), so each is made once a step."""
        key = ("flashinfer", window, softcap, scale)
        wrapper = self._wrapper(key)
        if key not in planned:
            _, block_size, kv_heads, head_dim = k_cache.shape
            indptr, indices, last = paged_csr(block_tables, context_lens, block_size)
            wrapper.plan(indptr, indices, last, q.shape[1], kv_heads, head_dim, block_size,
                         pos_encoding_mode="NONE", window_left=-1 if window is None else window - 1,
                         logits_soft_cap=softcap, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
            planned[key] = True
        return wrapper.run(q, (k_cache, v_cache))

    def _wrapper(self, key: tuple) -> object:
        if key not in self.wrappers:
            if self.workspace is None:
                self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            self.wrappers[key] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self.wrappers[key]
