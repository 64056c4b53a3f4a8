"""Adaptive KV compression, the tensor half (--kv-compress fp4): the FP4 region that old pages move into,
and the per-layer view through which attention reads block tables that mix hot and cold ids.

The KV memory budget is split: a share holds hot blocks in --kv-cache-dtype (the serving dtype or fp8), the
rest FP4 pages (engine/kv/formats.py), about 3.5x (bf16) or 1.8x (fp8) more of them per byte. Cold block
ids follow the hot ones (`first_cold` = number of hot blocks), so a sequence's block table can name both.
The hot region is the pool an actor exports; the cold one stays private to the engine that owns it, so a
prefill actor writing a decode actor's pool only ever sees hot blocks.

Which pages move and when is engine/kv/compaction.py's business; `ColdRegion.compress` copies them, one batched
FP4 kernel call per layer (keys and values together), before the forward pass of the step that moved them.
A compressed page was full when it moved, so it is quantised exactly once.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from engine.config import ModelConfig
from engine.kv.cache import KVCache, LayerPages, bytes_per_block, choose_num_blocks
from engine.kv.formats import QuantizedPages

COLD_FORMAT = "fp4"
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def split_kv_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_format: str, num_blocks: int | None,
                    memory_bytes: int | None, available_bytes: int, cold_share: float) -> tuple[int, int]:
    """(hot blocks, cold blocks) for the budget that choose_num_blocks would give the hot format alone
    (an explicit block count stands for the memory of that many hot blocks), `cold_share` of it cold."""
    total = choose_num_blocks(cfg, block_size, dtype, num_blocks, memory_bytes, available_bytes, kv_format)
    hot_bytes = bytes_per_block(cfg, block_size, dtype, kv_format)
    cold_bytes = bytes_per_block(cfg, block_size, dtype, COLD_FORMAT)
    num_hot = int(total * (1.0 - cold_share))
    num_cold = int(total * cold_share * hot_bytes) // cold_bytes
    if num_hot < 1 or num_cold < 1:
        raise ValueError(f"a KV budget of {total} blocks splits into {num_hot} hot and {num_cold} FP4 blocks; "
                         "both regions need at least one: raise the budget or change --kv-compress-share")
    return num_hot, num_cold


def names_cold(block_tables: Iterable[list[int]], first_cold: int) -> bool:
    return any(table and max(table) >= first_cold for table in block_tables)


class TieredPages:
    """One layer's keys (or values) in both regions. New tokens are written to `hot` (they always land in hot
    blocks); `gather` reads hot ids as they are and dequantises cold ones."""

    def __init__(self, hot: LayerPages, cold: QuantizedPages, first_cold: int) -> None:
        self.hot = hot
        self.cold = cold
        self.first_cold = first_cold

    def gather(self, block_tables: torch.Tensor) -> torch.Tensor:
        """block_tables [B, nb] of hot and cold ids -> [B, nb, bs, H, D] in the serving dtype."""
        is_cold = block_tables >= self.first_cold
        hot_ids = block_tables.masked_fill(is_cold, 0)
        blocks = self.hot[hot_ids] if isinstance(self.hot, torch.Tensor) else self.hot.gather(hot_ids)
        cold_ids = block_tables[is_cold] - self.first_cold
        blocks[is_cold] = self.cold.dequantize(cold_ids, blocks.dtype)
        return blocks


class ColdRegion:
    """The FP4 pages of block ids first_cold .. first_cold + num_blocks - 1, all layers in one tensor."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, first_cold: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.cache = KVCache(cfg, num_blocks, block_size, dtype, device, kv_format=COLD_FORMAT)
        self.first_cold = first_cold

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def layers_over(self, hot: KVCache) -> list[tuple[TieredPages, TieredPages]]:
        """Per-layer (keys, values) views over `hot` and this region, for the model's forward."""
        return [(TieredPages(hk, ck, self.first_cold), TieredPages(hv, cv, self.first_cold))
                for (hk, hv), (ck, cv) in zip(hot.layers, self.cache.layers)]

    def compress(self, hot: KVCache, moves: Sequence[tuple[int, int]]) -> None:
        """Quantise each move's hot page (every layer, keys and values) into its cold block."""
        device = self.cache.data.device
        src = torch.tensor([h for h, _ in moves], dtype=torch.long, device=device)
        dst = torch.tensor([c - self.first_cold for _, c in moves], dtype=torch.long, device=device)
        for layer, ((k_hot, v_hot), (k_cold, _)) in enumerate(zip(hot.layers, self.cache.layers)):
            pages = torch.cat([_read_pages(k_hot, src), _read_pages(v_hot, src)])  # [2P, bs, H, D]
            self.cache.data[layer][:, dst] = k_cold.encode(pages).view(2, len(moves), -1)


def _read_pages(pages: LayerPages, block_ids: torch.Tensor) -> torch.Tensor:
    """[P, bs, H, D] in a dtype the FP4 encoder reads (fp8 pages are dequantised to fp32 first)."""
    if isinstance(pages, QuantizedPages):
        return pages.dequantize(block_ids, torch.float32)
    x = pages.index_select(0, block_ids)
    return x if x.dtype in _KERNEL_DTYPES else x.float()
