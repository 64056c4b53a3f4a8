from __future__ import annotations

import pytest

from tests.tiny_models import tiny_llama_config, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with grouped-query attention and the tiny BPE tokenizer (vocab 512)."""
    config = tiny_llama_config(num_key_value_heads=2, max_position_embeddings=1024)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), config, seed=7)
