"""The FLOP count of bench/prefill_rate.py: the matrix weights a config counts (ModelConfig.matrix_weights)
against the parameters of the model the engine builds, and the causal (and windowed) attention count against a
count of every query-key pair."""
from __future__ import annotations

import dataclasses

import pytest

from bench.prefill_rate import attention_flops
from engine import LLM
from tests.tiny_models import tiny_gemma3_config, write_tiny_model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return LLM(str(write_tiny_model(tmp_path_factory.mktemp("gemma3"), tiny_gemma3_config(sliding_window=8))),
               dtype="float32", num_kv_blocks=16)


def pairs_seen(tokens: int, window: int | None) -> int:
    """Query-key pairs of a causal prompt, one by one: query i sees keys max(0, i - window + 1) .. i."""
    return sum(1 for i in range(tokens) for j in range(i + 1) if window is None or i - j < window)


def test_the_configs_matrix_weights_are_the_models_projection_weights(tiny_model_dir, gemma3):
    for llm in (LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16), gemma3):
        model = llm.engine.runner.model
        projections = sum(p.numel() for name, p in model.named_parameters() if name.endswith("proj.weight"))
        assert projections > 0 and llm.engine.source.config.matrix_weights == projections


@pytest.mark.parametrize("tokens", [1, 5, 8, 9, 40])
def test_attention_counts_every_pair_a_query_sees(gemma3, tokens):
    cfg = gemma3.engine.source.config
    assert cfg.sliding_window == 8 and any(cfg.sliding_layers) and not all(cfg.sliding_layers)
    per_pair = 4 * cfg.num_heads * cfg.head_dim  # QK^T and PV, a multiply and an add each
    expected = sum(pairs_seen(tokens, cfg.sliding_window if windowed else None) for windowed in cfg.sliding_layers)
    assert attention_flops(cfg, tokens) == per_pair * expected
    full = dataclasses.replace(cfg, sliding_window=None, sliding_layers=())
    assert attention_flops(full, tokens) == per_pair * cfg.num_layers * pairs_seen(tokens, None)

