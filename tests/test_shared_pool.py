"""engine.kv.export's size check against the free space it is told of (EngineConfig.shm_free_bytes)."""
from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.kv.export import SharedMemoryError, create_shared_pool

MIB = 1 << 20


def test_a_pool_larger_than_the_assumed_free_space_is_refused_with_both_sizes() -> None:
    with pytest.raises(SharedMemoryError, match=r"has 1 MiB free .* needs 2 MiB"):
        create_shared_pool((2 * MIB,), torch.uint8, tag="test-small", assume_free=MIB)


def test_a_pool_within_the_assumed_free_space_is_created() -> None:
    pool = create_shared_pool((MIB,), torch.uint8, tag="test-fits", assume_free=MIB)
    try:
        assert pool.tensor.numel() == MIB and pool.export["kind"] == "shm"
    finally:
        pool.close()


def test_the_assumed_free_space_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="shm_free_bytes"):
        EngineConfig(shm_free_bytes=0)
