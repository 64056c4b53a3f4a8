"""KV bytes one sequence holds, with and without sliding-window KV freeing (engine/kv/groups.py), for the
Gemma 3 1B attention shape (26 layers, every sixth global, the rest windowed over 512 tokens).

    python -m bench.window_kv [--tokens 4096,32768] [--block-size 16] [--kv-format auto]

Counted, not timed: the blocks a sequence of N computed tokens holds are what the scheduler keeps (the full
group's every block; each windowed group's blocks from the window of position N on), times the bytes of one
pool block in each layout. bf16 pages (kv-format auto); fp8 and fp4 scale both columns alike.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from engine.config import ModelConfig
from engine.kv.cache import bytes_per_block
from engine.kv.groups import KVGroups, blocks_in_use


def gemma3_1b() -> ModelConfig:
    return ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512,
                       sliding_layers=tuple((i + 1) % 6 != 0 for i in range(26)), max_position_embeddings=32768)


def kv_bytes(cfg: ModelConfig, free: bool, tokens: int, block_size: int, kv_format: str) -> int:
    """Bytes of KV one sequence of `tokens` computed tokens holds."""
    groups = KVGroups.for_model(cfg, free_windows=free)
    block = bytes_per_block(cfg, block_size, torch.bfloat16, kv_format, groups)
    return blocks_in_use(groups, tokens, block_size) * block


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,32768")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-format", default="auto", choices=("auto", "fp8", "fp4"))
    a = p.parse_args(argv)
    cfg = gemma3_1b()
    print(f"Gemma 3 1B shape, {a.kv_format} pages, block size {a.block_size}: KV bytes per sequence")
    for tokens in map(int, a.tokens.split(",")):
        kept, freed = (kv_bytes(cfg, free, tokens, a.block_size, a.kv_format) for free in (False, True))
        print(f"{tokens:>6} tokens: {kept / 2**20:8.1f} MiB without freeing, {freed / 2**20:7.1f} MiB with "
              f"({freed / kept:.1%})")


if __name__ == "__main__":
    main()
