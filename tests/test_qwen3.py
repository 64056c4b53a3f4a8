"""Qwen3 (q/k RMSNorm per head, explicit head_dim) from a Hugging Face folder and from GGUF, against transformers.

The per-variant prefill, chunked-prefill and decode logit checks are in test_model_parity.py (the qwen3
variants of its checkpoint fixture); here: the config, whole greedy generations through the engine's paged
cache, the GGUF path (written with the gguf package's own writer and Hugging Face -> GGUF name map), and the
CPU kernel backend with its C++ decode stack (whose bit-identity with the Python layers test_decode_stack.py
checks on a Qwen3 too).
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

from engine import LLM, SamplingParams
from engine.backends.attention import AttentionMetadata
from engine.kv.cache import KVCache
from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import read_gguf
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.kernel_helpers import kernel_model, require_kernels
from tests.kernel_helpers import stack_calls  # noqa: F401 (fixture)
from tests.test_model_parity import assert_close_relative, decode_logits, paged_logits, reference_logits
from tests.tiny_models import tiny_qwen3_config, write_tiny_model

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 9, 33, 2, 7, 100, 3], [11, 12, 13], list(range(400, 431)), [21]]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """Untied LM head, two kv heads for four q heads, head_dim 32 with hidden 64."""
    config = tiny_qwen3_config(tie_word_embeddings=False)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), config, seed=2, random_norms=True)


def hf_reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_from_hf_folder(qwen3_dir):
    cfg = read_hf_config(qwen3_dir)
    assert cfg.architecture == "qwen3" and cfg.qk_norm
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_size) == (4, 2, 32, 128)
    assert not cfg.attention_bias and not cfg.attention_out_bias and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6


@pytest.mark.parametrize("overrides", [dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
                                       dict(layer_types=["full_attention", "sliding_attention"])],
                         ids=["use-sliding-window", "layer-types"])
def test_sliding_window_qwen3_is_refused(tmp_path, overrides):
    tiny_qwen3_config(**overrides).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="sliding-window"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("options", [dict(enable_chunked_prefill=False), dict(max_num_batched_tokens=8)],
                         ids=["whole-prefill", "chunked-8"])
def test_engine_greedy_tokens_equal_transformers_generate(qwen3_dir, options):
    """fp32 greedy generations through the engine (paged cache, batched decode steps) against transformers'
    generate on the same folder, one prompt at a time."""
    llm = LLM(str(qwen3_dir), dtype="float32", num_kv_blocks=64, block_size=4, **options)
    ours = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))]
    ref = hf_reference(qwen3_dir)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == expected


# ---- GGUF ----------------------------------------------------------------------------------------------


def write_qwen3_gguf(folder: Path, path: Path, qtype: Q = Q.F32) -> dict[str, np.ndarray]:
    """The folder's model as a qwen3 GGUF, with its matrices in `qtype`; returns the weights as stored,
    dequantised by the gguf package's reference code, under their Hugging Face names."""
    cfg = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "qwen3")
    arch = "qwen3"
    for key, value in {"block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
                       "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
                       "attention.head_count": cfg["num_attention_heads"],
                       "attention.head_count_kv": cfg["num_key_value_heads"],
                       "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"]}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", read_hf_config(folder).rope_theta)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m
                                               for m in spec["model"]["merges"]])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg["num_hidden_layers"])
    stored = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        w = tensor.numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if qtype == Q.F32 or w.ndim == 1:
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


def test_gguf_config_and_f32_weights_equal_the_hf_folder(qwen3_dir, tmp_path):
    write_qwen3_gguf(qwen3_dir, tmp_path / "m.gguf")
    loaded, hf_cfg = read_gguf(tmp_path / "m.gguf"), read_hf_config(qwen3_dir)
    assert loaded.config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # stored as float32
    assert replace(loaded.config, rms_norm_eps=hf_cfg.rms_norm_eps, max_position_embeddings=512) == hf_cfg
    hf_weights = dict(iter_hf_weights(qwen3_dir))
    assert loaded.weights.keys() == hf_weights.keys()
    for name, w in hf_weights.items():
        torch.testing.assert_close(loaded.weights[name], w, rtol=0, atol=0, msg=name)


def test_gguf_logits_equal_the_hf_folder_load(qwen3_dir, tmp_path):
    """Prefill (whole and chunked) and token-by-token decode of the GGUF load against the folder's load and
    against transformers."""
    write_qwen3_gguf(qwen3_dir, tmp_path / "m.gguf")
    loaded = read_gguf(tmp_path / "m.gguf")
    from_gguf = build_model(loaded.config, loaded.weights.items(), torch.float32)
    from_folder = build_model(read_hf_config(qwen3_dir), iter_hf_weights(qwen3_dir), torch.float32)
    ids = torch.randint(0, loaded.config.vocab_size, (23,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = reference_logits(qwen3_dir, ids)
    for chunk in (1000, 5):
        ours = paged_logits(from_gguf, loaded.config, ids, chunk)
        torch.testing.assert_close(ours, paged_logits(from_folder, loaded.config, ids, chunk), rtol=0, atol=0)
        assert_close_relative(ours, ref, 1e-4)
    assert_close_relative(decode_logits(from_gguf, loaded.config, ids), ref, 1e-4)


def test_q8_0_gguf_logits_match_transformers_on_the_dequantised_weights(qwen3_dir, tmp_path):
    """A Q8_0 file: the engine's dequantisation and forward against transformers' Qwen3 holding the gguf
    package's reference dequantisation of the same blocks."""
    stored = write_qwen3_gguf(qwen3_dir, tmp_path / "m.gguf", Q.Q8_0)
    loaded = read_gguf(tmp_path / "m.gguf")
    model = build_model(loaded.config, loaded.weights.items(), torch.float32)
    ref = hf_reference(qwen3_dir)
    ref.load_state_dict({name: torch.from_numpy(np.ascontiguousarray(w)) for name, w in stored.items()})
    ids = torch.randint(0, loaded.config.vocab_size, (19,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert_close_relative(paged_logits(model, loaded.config, ids, 6), expected, 1e-4)


# ---- the CPU kernel backend ----------------------------------------------------------------------------


def test_cpu_kernels_decode_qwen3_within_bf16_rounding(qwen3_dir, stack_calls):
    """bf16 on the kernel backend: decode steps take the C++ stack, q/k norms included, and the logits stay
    within bf16 rounding of the fp32 reference."""
    require_kernels(vectors=True)
    model = kernel_model(qwen3_dir)
    assert model.prepared.stack is not None
    cfg = model.cfg
    ids = PROMPTS[2][:13]
    block = 4
    kv = KVCache(cfg, 8, block, torch.bfloat16)
    table = list(range(8))
    rows = []
    with torch.inference_mode():
        for pos, tok in enumerate(ids):
            meta = AttentionMetadata.build(block, [(table, pos + 1)], [], True)
            rows.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([pos]), meta, kv.layers)))
    assert stack_calls == [1] * len(ids)
    assert_close_relative(torch.cat(rows), reference_logits(qwen3_dir, ids), 5e-2)
