"""Gemma 2 and Gemma 3: configs as transformers reads them, from the config.json shapes found on the Hub (older
keys) as well as from what this transformers writes; the one-sentence refusals around them; and GGUF files
written by the gguf package (llama.cpp's tensor names, norms stored as 1 + w, its metadata keys), whose logits
equal transformers' on the same weights.

The logit and generation parity of the folders (and of Mistral's window) is in test_sliding_window.py.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import read_gguf
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.test_model_parity import assert_close_relative, decode_logits, paged_logits, reference_logits
from tests.tiny_models import tiny_gemma2_config, tiny_gemma3_config, tiny_mistral_config, write_tiny_model

Q = gguf.GGMLQuantizationType


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


MINIMAL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "mistral"])
def test_keys_a_config_leaves_out_take_transformers_defaults(folder, model_type):
    """A config.json of only the shapes: window, layer pattern, caps, query scalar and RoPE bases as
    transformers' own config class fills them in."""
    from transformers import AutoConfig

    raw = dict(MINIMAL, model_type=model_type)
    if model_type == "mistral":
        raw.pop("head_dim")
    cfg = read_hf_config(write_config(folder, raw))
    hf = AutoConfig.from_pretrained(folder)
    assert cfg.sliding_window == hf.sliding_window
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    assert [cfg.layer_window(i) is not None for i in range(7)] == [k == "sliding_attention" for k in kinds]
    if model_type != "mistral":
        assert cfg.attention_scale == hf.query_pre_attn_scalar ** -0.5
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (hf.attn_logit_softcapping,
                                                                      hf.final_logit_softcapping)
    if model_type == "gemma3_text":
        params = hf.rope_parameters
        assert (cfg.rope_theta, cfg.rope_local_theta) == (params["full_attention"]["rope_theta"],
                                                          params["sliding_attention"]["rope_theta"])


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


# ---- GGUF ----------------------------------------------------------------------------------------------

# GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim (27B aside), so these folders do too
GGUF_CONFIGS = {"gemma2": lambda: tiny_gemma2_config(query_pre_attn_scalar=32),
                "gemma3": lambda: tiny_gemma3_config(query_pre_attn_scalar=32)}
GGUF_ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}


@pytest.fixture(scope="module", params=list(GGUF_CONFIGS))
def gemma_dir(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), GGUF_CONFIGS[request.param](), seed=4,
                            random_norms=True)


def write_gemma_gguf(folder: Path, path: Path, qtype: Q = Q.F32) -> dict[str, np.ndarray]:
    """The folder's model as llama.cpp's converter writes a Gemma 2/3 GGUF, its matrices in `qtype`; returns the
    weights as stored (dequantised by the gguf package, norms back to transformers' w) under their HF names."""
    cfg = read_hf_config(folder)
    arch = cfg.architecture
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
                       "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                       "attention.sliding_window": cfg.sliding_window}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    if arch == "gemma2":  # its alternating layers are llama.cpp's default: no pattern key
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcap)
        writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    else:
        writer.add_sliding_window_pattern(list(cfg.sliding_layers))
        writer.add_rope_freq_base_swa(cfg.rope_local_theta)
        writer.add_string(f"{arch}.rope.scaling.type", cfg.rope_scaling.kind)
        writer.add_float32(f"{arch}.rope.scaling.factor", cfg.rope_scaling.factor)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m
                                               for m in spec["model"]["merges"]])
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_layers)
    stored = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        w = tensor.numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if w.ndim == 1:  # norms, in llama.cpp's 1 + w
            writer.add_tensor(gguf_name, w + np.float32(1.0))
            stored[name] = (w + np.float32(1.0)) - np.float32(1.0)
        elif qtype == Q.F32:
            writer.add_tensor(gguf_name, w)
            stored[name] = w
        else:
            raw = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name, raw, raw_shape=gguf.quants.quant_shape_to_byte_shape(w.shape, qtype),
                              raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def test_gguf_config_and_weights_equal_the_hf_folder(gemma_dir, tmp_path):
    stored = write_gemma_gguf(gemma_dir, tmp_path / "m.gguf")
    loaded, hf_cfg = read_gguf(tmp_path / "m.gguf"), read_hf_config(gemma_dir)
    assert loaded.config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # stored as float32
    assert replace(loaded.config, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    assert loaded.weights.keys() == stored.keys()
    for name, w in stored.items():
        torch.testing.assert_close(loaded.weights[name], torch.from_numpy(w), rtol=0, atol=0, msg=name)


def test_gguf_logits_equal_transformers(gemma_dir, tmp_path):
    """Whole and chunked prefill (chunks across the window's edge) and decode past the window, of the GGUF load,
    against transformers on the folder."""
    write_gemma_gguf(gemma_dir, tmp_path / "m.gguf")
    loaded = read_gguf(tmp_path / "m.gguf")
    model = build_model(loaded.config, loaded.weights.items(), torch.float32)
    ids = torch.randint(0, loaded.config.vocab_size, (29,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = reference_logits(gemma_dir, ids)
    for chunk in (1000, 5):
        assert_close_relative(paged_logits(model, loaded.config, ids, chunk), ref, 1e-4)
    assert_close_relative(decode_logits(model, loaded.config, ids), ref, 1e-4)


def test_q8_0_gguf_logits_match_transformers_on_the_dequantised_weights(gemma_dir, tmp_path):
    stored = write_gemma_gguf(gemma_dir, tmp_path / "m.gguf", Q.Q8_0)
    loaded = read_gguf(tmp_path / "m.gguf")
    model = build_model(loaded.config, loaded.weights.items(), torch.float32)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    result = ref.load_state_dict({name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in stored.items()},
                                 strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.randint(0, loaded.config.vocab_size, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert_close_relative(paged_logits(model, loaded.config, ids, 6), expected, 1e-4)
