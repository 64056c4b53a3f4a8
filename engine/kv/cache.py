"""The paged KV cache: one contiguous tensor holding every layer's key and value pages.

Layout [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] in the serving dtype (kv_format "auto"),
or, for a quantised pool (kv_format "fp8" / "fp4", see engine/kv/formats.py), uint8
[num_layers, 2, num_blocks, page_bytes] with each page's scales stored inside it. Keeping it one tensor lets
an actor export the whole pool once (shared memory on CPU, a CUDA IPC handle on GPU) and lets a block move
as `data[:, :, block_id]`.

With KV-cache groups (engine/kv/groups.py) the first axis is the storage slot, not the layer: layer l keeps
its pages in slot `groups.layer_slots[l]`, so a pool block is one group's worth of layers. The plain layout
(one group, slot = layer) is the only one exported or handed off.
"""
from __future__ import annotations

import zlib
from typing import Any, Union

import torch

from engine.config import ModelConfig
from engine.kv.formats import PageFormat, QuantizedPages, fingerprint_offsets, page_format
from engine.kv.groups import KVGroups

DEFAULT_KV_FRACTION = 0.2  # of available memory, when neither a block count nor a byte budget is given
MAX_DEFAULT_KV_BYTES = 1 << 30

LayerPages = Union[torch.Tensor, QuantizedPages]  # [num_blocks, bs, H, D] in the serving dtype, or quantised


def _page_format(cfg: ModelConfig, block_size: int, kv_format: str) -> PageFormat | None:
    return None if kv_format == "auto" else page_format(kv_format, block_size, cfg.num_kv_heads, cfg.head_dim)


def _slots(cfg: ModelConfig, groups: KVGroups | None) -> int:
    return cfg.num_layers if groups is None else groups.group_size


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_format: str = "auto",
                    groups: KVGroups | None = None) -> int:
    """Bytes of one pool block: every layer's page (plain layout) or one group's layers' pages."""
    fmt = _page_format(cfg, block_size, kv_format)
    page_bytes = block_size * cfg.kv_size * dtype.itemsize if fmt is None else fmt.page_bytes
    return _slots(cfg, groups) * 2 * page_bytes


def grouped_num_blocks(cfg: ModelConfig, plain_blocks: int, groups: KVGroups) -> int:
    """The pool blocks of `groups` that fit in the memory of `plain_blocks` blocks of every layer: --num-kv-blocks
    and --kv-cache-memory name the same bytes whatever the layout."""
    return plain_blocks * cfg.num_layers // groups.group_size


def choose_num_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_blocks: int | None,
                      memory_bytes: int | None, available_bytes: int, kv_format: str = "auto") -> int:
    """An explicit block count wins, then a byte budget, then a share of the memory that is free now."""
    if num_blocks is not None:
        return num_blocks
    budget = memory_bytes or min(int(available_bytes * DEFAULT_KV_FRACTION), MAX_DEFAULT_KV_BYTES)
    block_bytes = bytes_per_block(cfg, block_size, dtype, kv_format)
    if budget < block_bytes:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {block_bytes} bytes; "
                         "raise --kv-cache-memory")
    return budget // block_bytes


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", storage: torch.Tensor | None = None,
                 kv_format: str = "auto", groups: KVGroups | None = None) -> None:
        """`dtype` is the serving dtype (what attention computes in); a quantised pool stores uint8. `groups`:
        the KV-cache groups (None: the plain layout, one group of every layer)."""
        self.groups = groups or KVGroups.single(cfg.num_layers)
        shape = self.shape_for(cfg, num_blocks, block_size, kv_format, self.groups)
        storage_dtype = self.storage_dtype(dtype, kv_format)
        if storage is None:
            storage = torch.zeros(shape, dtype=storage_dtype, device=device)
        elif tuple(storage.shape) != shape or storage.dtype != storage_dtype:
            raise ValueError(f"KV storage is {tuple(storage.shape)} {storage.dtype}, "
                             f"expected {shape} {storage_dtype} for kv_format {kv_format!r}")
        self.data = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv_format = kv_format
        self.page_format = _page_format(cfg, block_size, kv_format)
        self.layers: list[tuple[LayerPages, LayerPages]] = [
            (self._pages(storage[slot, 0]), self._pages(storage[slot, 1])) for slot in self.groups.layer_slots]

    @classmethod
    def from_export(cls, cfg: ModelConfig, num_blocks: int, block_size: int, storage: torch.Tensor,
                    export: dict[str, Any], dtype: torch.dtype) -> "KVCache":
        """Wrap a pool another actor exported (`export` is its Ready.kv_export); `dtype` is this side's
        serving dtype, used when the pool is quantised (an unquantised pool is its own dtype)."""
        kv_format = export.get("kv_format", "auto")
        serving = storage.dtype if kv_format == "auto" else dtype
        return cls(cfg, num_blocks, block_size, serving, storage.device, storage, kv_format)

    @staticmethod
    def shape_for(cfg: ModelConfig, num_blocks: int, block_size: int, kv_format: str = "auto",
                  groups: KVGroups | None = None) -> tuple[int, ...]:
        fmt = _page_format(cfg, block_size, kv_format)
        if fmt is None:
            return (_slots(cfg, groups), 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return (_slots(cfg, groups), 2, num_blocks, fmt.page_bytes)

    @staticmethod
    def storage_dtype(dtype: torch.dtype, kv_format: str = "auto") -> torch.dtype:
        return dtype if kv_format == "auto" else torch.uint8

    def _pages(self, layer: torch.Tensor) -> LayerPages:
        return layer if self.page_format is None else QuantizedPages(layer, self.page_format, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block: every layer's page, or with KV-cache groups one group's layers' pages."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def bytes_per_token(self) -> float:
        """KV bytes of one token in every layer, what a hand-off moves per token (exact: block_size is a power of
        two); a pool block's bytes / block_size in the plain layout."""
        return self.bytes_per_layer_block * len(self.layers) / self.block_size

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of one block's keys and values in one layer (what read_pages yields per block)."""
        return self.bytes_per_block // self.data.shape[0]

    def read_pages(self, layer: int, block_ids: list[int]) -> bytes:
        """One layer's keys and values of `block_ids`, as raw bytes laid out [2, len(block_ids), *page]: what
        travels to a peer on another host, which cannot map this pool (write_pages is the other end)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
        pages = self.data[layer].index_select(1, ids)  # [2, n, *page]
        return pages.contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def write_pages(self, layer: int, block_ids: list[int], payload: bytes | bytearray | memoryview) -> None:
        """Copy read_pages' bytes (from a pool of the same model, block size and format) into `block_ids`. A
        writable buffer (what a KV stream receives into) is read in place; `bytes` are copied once first."""
        if not 0 <= layer < self.data.shape[0]:
            raise ValueError(f"layer {layer} is outside the pool's {self.data.shape[0]} layers")
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids outside the pool of {self.num_blocks} blocks")
        if len(payload) != len(block_ids) * self.bytes_per_layer_block:
            raise ValueError(f"{len(payload)} bytes of pages for {len(block_ids)} blocks of "
                             f"{self.bytes_per_layer_block} bytes")
        if not block_ids:
            return
        writable = isinstance(payload, bytearray) or (isinstance(payload, memoryview) and not payload.readonly)
        pages = torch.frombuffer(payload if writable else bytearray(payload), dtype=torch.uint8)
        pages = pages.view(self.data.dtype).view(2, len(block_ids), *self.data.shape[3:])
        layer_pages = self.data[layer]  # [2, N, *page]
        first = block_ids[0] if block_ids else 0
        if block_ids == list(range(first, first + len(block_ids))):  # one run of blocks: a plain copy
            layer_pages[:, first:first + len(block_ids)].copy_(pages)
        else:
            ids = torch.tensor(block_ids, dtype=torch.long, device=self.data.device)
            layer_pages.index_copy_(1, ids, pages.to(self.data.device))

    def checksum(self, block_ids: list[int]) -> tuple[int, int]:
        """(bytes written, crc32 of a fingerprint) of the given blocks, computed by the writer of a hand-off
        and again by the owner before it decodes from them.

        The fingerprint covers the first and last layer, keys and values, the first and last slot of every
        block (and, in a quantised pool, every page's scales): cheap enough to run on the decode actor's
        step thread, and it still catches what actually goes wrong with pages shared in place: a writer
        holding a stale mapping (the owner restarted with a new pool), wrong block ids, or pages
        overwritten after the writer reported ready.
        """
        if not block_ids:
            return 0, 0
        device = self.data.device
        blocks = torch.tensor(block_ids, dtype=torch.long, device=device)[:, None]
        last = self.data.shape[0] - 1
        if self.page_format is None:
            slots = torch.tensor([0, self.block_size - 1], device=device)[None, :]
            sample = torch.stack([self.data[layer][:, blocks, slots] for layer in (0, last)])  # [2, 2, nb, 2, H, D]
        else:
            offsets = fingerprint_offsets(self.page_format).to(device)[None, :]
            sample = torch.stack([self.data[layer][:, blocks, offsets] for layer in (0, last)])  # [2, 2, nb, S]
        num_bytes = len(block_ids) * self.bytes_per_block
        return num_bytes, zlib.crc32(sample.contiguous().view(torch.uint8).cpu().numpy())
