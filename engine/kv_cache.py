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
        """(bytes written, crc32 of a fingerprint) of the given blocks, computed by the writer of a hand-off
        and again by the owner before it decodes from them.

        The fingerprint covers the first and last layer, keys and values, the first and last slot of every
        block: cheap enough to run on the decode actor's step thread, and it still catches what actually
        goes wrong with pages shared in place: a writer holding a stale mapping (the owner restarted with a
        new pool), wrong block ids, or pages overwritten after the writer reported ready.
        """
        if not block_ids:
            return 0, 0
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)[:, None]
        slots = torch.tensor([0, self.block_size - 1], device=self.data.device)[None, :]
        last = self.data.shape[0] - 1
        sample = torch.stack([self.data[layer][:, blocks, slots] for layer in (0, last)])  # [2, 2, nb, 2, H, D]
        num_bytes = len(block_ids) * self.data[:, :, 0].numel() * self.data.element_size()
        return num_bytes, zlib.crc32(sample.contiguous().view(torch.uint8).cpu().numpy())
