"""The paged KV cache: one contiguous tensor holding every layer's key and value pages.

Layout [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]. Keeping it one tensor lets an actor
export the whole pool once (shared memory on CPU, a CUDA IPC handle on GPU) and lets a block move as
`data[:, :, block_id]`.
"""
from __future__ import annotations

import zlib

import torch

from engine.config import ModelConfig

DEFAULT_KV_FRACTION = 0.2  # of available memory, when neither a block count nor a byte budget is given
MAX_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return cfg.num_layers * 2 * block_size * cfg.kv_size * dtype.itemsize


def choose_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_blocks: int | None,
                      memory_bytes: int | None, available_bytes: int) -> int:
    """An explicit block count wins, then a byte budget, then a share of the memory that is free now."""
    if num_blocks is not None:
        return num_blocks
    budget = memory_bytes or min(int(available_bytes * DEFAULT_KV_FRACTION), MAX_DEFAULT_KV_BYTES)
    blocks = budget // bytes_per_block(cfg, block_size, dtype)
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of "
                         f"{bytes_per_block(cfg, block_size, dtype)} bytes; raise --kv-cache-memory")
    return blocks


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", storage: torch.Tensor | None = None) -> None:
        shape = self.shape_for(cfg, num_blocks, block_size)
        if storage is None:
            storage = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(storage.shape) != shape or storage.dtype != dtype:
            raise ValueError(f"KV storage is {tuple(storage.shape)} {storage.dtype}, expected {shape} {dtype}")
        self.data = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers = [(storage[i, 0], storage[i, 1]) for i in range(cfg.num_layers)]

    @staticmethod
    def shape_for(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.data[:, :, 0, 0].numel() * self.data.element_size()

    def checksum(self, block_ids: list[int]) -> tuple[int, int]:
        """(bytes, crc32) of the given blocks across all layers: proves a hand-off wrote what was computed."""
        if not block_ids:
            return 0, 0
        index = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        pages = self.data.index_select(2, index).contiguous().view(torch.uint8).cpu().numpy()
        return pages.nbytes, zlib.crc32(pages)
