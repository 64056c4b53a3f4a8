"""Gemma 2 and Gemma 3 configs as transformers reads them, from the config.json shapes found on the Hub (older
keys) as well as from what this transformers writes, and the one-sentence refusals around them.

The logit and generation parity of these models (and of Mistral's window) is in test_sliding_window.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model.errors import ModelLoadError
from engine.model.hf_loader import read_hf_config
from tests.tiny_models import tiny_gemma2_config, tiny_gemma3_config, tiny_mistral_config


def write_config(folder: Path, raw: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


HUB_GEMMA3 = {  # the shape of google/gemma-3-1b-it's config.json (trimmed): no layer_types, older rope keys
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": [1, 106]}

HUB_GEMMA2 = {  # the shape of google/gemma-2-2b-it's config.json (trimmed)
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "sliding_window": 4096, "query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "cache_implementation": "hybrid", "bos_token_id": 2, "eos_token_id": 1}


@pytest.fixture()
def folder(tmp_path) -> Path:
    return tmp_path / "model"


def test_hub_gemma2_config_alternates_windowed_and_global_layers(folder):
    cfg = read_hf_config(write_config(folder, HUB_GEMMA2))
    assert cfg.architecture == "gemma2" and cfg.sandwich_norms and cfg.scale_embeddings
    assert [cfg.layer_window(i) for i in range(5)] == [4096, None, 4096, None, 4096]
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.attention_scale) == (50.0, 30.0, 256 ** -0.5)
    assert cfg.hidden_act == "gelu_tanh" and cfg.norm_weight_offset == 1.0 and cfg.tie_word_embeddings
    assert not cfg.qk_norm and cfg.rope_local_theta is None


def test_hub_gemma3_config_reads_the_pattern_and_the_local_rope_base(folder):
    cfg = read_hf_config(write_config(folder, HUB_GEMMA3))
    assert cfg.architecture == "gemma3" and cfg.qk_norm
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.attn_logit_softcap is None and cfg.final_logit_softcap is None and cfg.eos_token_ids == (1, 106)


def test_gemma3_global_rope_scaling_stays_off_the_windowed_layers(folder):
    raw = dict(HUB_GEMMA3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = read_hf_config(write_config(folder, raw))
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 8.0 and cfg.rope_local_theta == 1e4


def test_configs_written_by_transformers(tmp_path):
    tiny_gemma3_config().save_pretrained(tmp_path / "g3")
    cfg = read_hf_config(tmp_path / "g3")
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (1e6, 100.0, 2.0)
    assert cfg.sliding_layers == (True, True, False) * 2 and cfg.query_pre_attn_scalar == 48
    tiny_gemma2_config().save_pretrained(tmp_path / "g2")
    assert read_hf_config(tmp_path / "g2").sliding_layers == (True, False) * 2
    tiny_mistral_config(sliding_window=None).save_pretrained(tmp_path / "m")
    cfg = read_hf_config(tmp_path / "m")
    assert cfg.sliding_window is None and not cfg.windowed and cfg.attention_scale == 16 ** -0.5


@pytest.mark.parametrize("raw, words", [
    (dict(HUB_GEMMA3, model_type="gemma3"), ["gemma3 model", "gemma3_text", "gemma2", "llama"]),
    (dict(HUB_GEMMA3, model_type="gemma"), ["gemma model", "expected one of"]),
    (dict(HUB_GEMMA2, hidden_activation="relu", hidden_act="relu"), ["'relu'", "gelu_pytorch_tanh"]),
    (dict(HUB_GEMMA3, use_bidirectional_attention=True), ["bidirectional", "causal decoder"]),
    (dict(HUB_GEMMA3, layer_types=["chunked_attention"] * 7), ["chunked_attention", "sliding_attention"]),
], ids=["multimodal-gemma3", "gemma1", "activation", "bidirectional", "layer-type"])
def test_unsupported_variants_get_one_sentence(folder, raw, words):
    with pytest.raises(ModelLoadError) as err:
        read_hf_config(write_config(folder, raw))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
