"""GGUF loading: tiny synthetic files for each code path, and the default model against transformers."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import RopeScaling
from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import default_model_path, read_gguf
from engine.model.rope import inverse_frequencies
from engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import write_tiny_tokenizer

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 300
HEAD_DIM = HIDDEN // HEADS
LAYER_SHAPES = {
    "attn_q": ("self_attn.q_proj", (HIDDEN, HIDDEN)), "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)), "attn_output": ("self_attn.o_proj", (HIDDEN, HIDDEN)),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN)), "ffn_up": ("mlp.up_proj", (FFN, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN)), "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows of llama models."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tensors(arch: str, untied: bool, biases: bool, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (Hugging Face name, float32 weight) for a tiny random model."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": ("model.embed_tokens.weight", w(VOCAB, HIDDEN)),
               "output_norm.weight": ("model.norm.weight", w(HIDDEN))}
    if untied:
        tensors["output.weight"] = ("lm_head.weight", w(VOCAB, HIDDEN))
    for i in range(LAYERS):
        for part, (hf, shape) in LAYER_SHAPES.items():
            tensors[f"blk.{i}.{part}.weight"] = (f"model.layers.{i}.{hf}.weight", w(*shape))
        for part in ("attn_q", "attn_k", "attn_v") if biases else ():
            hf, shape = LAYER_SHAPES[part]
            tensors[f"blk.{i}.{part}.bias"] = (f"model.layers.{i}.{hf}.bias", w(shape[0]))
    return tensors


def stored(name: str, w: np.ndarray, arch: str) -> np.ndarray:
    if arch == "llama" and ".attn_q." in name:
        return llama_cpp_permute(w, HEADS)
    if arch == "llama" and ".attn_k." in name:
        return llama_cpp_permute(w, KV_HEADS)
    return w


def add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32 or w.ndim == 1:
        writer.add_tensor(name, w)
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_shape=gguf.quants.quant_shape_to_byte_shape(
            w.shape, qtype), raw_dtype=qtype)


def add_tokenizer(writer: gguf.GGUFWriter, folder: Path, model: str = "gpt2") -> None:
    write_tiny_tokenizer(folder, vocab_size=VOCAB)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_string("tokenizer.ggml.model", model)
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab["<|im_end|>"])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)


def write_gguf(path: Path, arch: str = "llama", qtype: Q = Q.F32, untied: bool = False, biases: bool = False,
               extra: dict[str, float | str] | None = None, rope_factors: np.ndarray | None = None,
               tokenizer_model: str = "gpt2") -> dict[str, np.ndarray]:
    """Writes a tiny model as llama.cpp would; returns its weights under Hugging Face names."""
    tensors = tiny_tensors(arch, untied, biases)
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    for key, value in (extra or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    add_tokenizer(writer, path.parent / "tok", tokenizer_model)
    for name, (_, w) in tensors.items():
        add_tensor(writer, name, stored(name, w, arch), qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(tensors.values())


@pytest.mark.parametrize("arch, biases", [("llama", False), ("llama", True), ("qwen2", True)])
def test_tiny_f32_weights_round_trip_exactly(tmp_path: Path, arch: str, biases: bool) -> None:
    expected = write_gguf(tmp_path / "m.gguf", arch=arch, biases=biases)
    model = read_gguf(tmp_path / "m.gguf")
    assert model.weights.keys() == expected.keys()
    for name, w in expected.items():
        assert model.weights[name].dtype == torch.float32
        torch.testing.assert_close(model.weights[name], torch.from_numpy(w), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("qtype, tolerance", [(Q.F16, 2e-3), (Q.BF16, 2e-2), (Q.Q8_0, 0.05), (Q.Q4_0, 0.6),
                                              (Q.Q4_1, 0.6)])
def test_tiny_quantised_weights_dequantise(tmp_path: Path, qtype: Q, tolerance: float) -> None:
    expected = write_gguf(tmp_path / "m.gguf", qtype=qtype)
    model = read_gguf(tmp_path / "m.gguf")
    for name, w in expected.items():
        assert model.weights[name].shape == w.shape, name
        assert (model.weights[name] - torch.from_numpy(w)).abs().max() < tolerance, name


def test_tiny_config_from_metadata(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", arch="qwen2", untied=True, biases=True)
    config = read_gguf(tmp_path / "m.gguf").config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (VOCAB, 256, 50000.0)
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.architecture == "qwen2" and config.attention_bias and not config.tie_word_embeddings
    assert config.rope_scaling is None and config.bos_token_id is None and config.eos_token_ids == (2,)


def test_tiny_tokenizer_from_gguf_matches_tokenizer_json(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf")
    ours, reference = read_gguf(tmp_path / "m.gguf").tokenizer, Tokenizer.from_hf_folder(tmp_path / "tok")
    text = "<|im_start|>user\nHello, café 😀 日本語 123!<|im_end|>\n"
    assert ours.encode(text) == reference.encode(text)
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == reference.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_linear_rope_scaling(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert read_gguf(tmp_path / "m.gguf").config.rope_scaling == RopeScaling("linear", 4.0)


def test_llama3_rope_factors_become_llama3_scaling(tmp_path: Path) -> None:
    scaling = RopeScaling("llama3", 8.0)
    factors = inverse_frequencies(HEAD_DIM, 50000.0, None) / inverse_frequencies(HEAD_DIM, 50000.0, scaling)
    write_gguf(tmp_path / "m.gguf", rope_factors=factors.numpy())
    assert read_gguf(tmp_path / "m.gguf").config.rope_scaling == scaling


@pytest.mark.parametrize("kwargs, expected", [
    ({"qtype": Q.Q5_0}, "Q5_0"),
    ({"arch": "gemma"}, "'gemma'"),
    ({"extra": {"llama.rope.scaling.type": "yarn"}}, "yarn"),
    ({"tokenizer_model": "llama"}, "'llama'"),
])
def test_unsupported_files_raise_model_load_error(tmp_path: Path, kwargs: dict, expected: str) -> None:
    write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ModelLoadError, match=expected):
        read_gguf(tmp_path / "m.gguf")


def test_missing_or_corrupt_file_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_gguf(tmp_path / "absent.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="GGUF"):
        read_gguf(tmp_path / "bad.gguf")


def test_default_model_path_points_at_the_packaged_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


@pytest.fixture(scope="module")
def default_model():
    return read_gguf(default_model_path())


@pytest.fixture(scope="module")
def transformers_state_dict() -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.state_dict()


@pytest.mark.slow
def test_default_model_config(default_model) -> None:
    c = default_model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.max_position_embeddings) == (1536, 49152, 1e5, 8192)
    assert c.tie_word_embeddings and c.architecture == "llama" and not c.attention_bias and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.eos_token_ids == (2,) and c.bos_token_id == 1
    assert default_model.tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_default_model_weights_equal_transformers(default_model, transformers_state_dict) -> None:
    theirs = {k: v for k, v in transformers_state_dict.items() if k != "lm_head.weight"}  # tied
    assert default_model.weights.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(default_model.weights[name], tensor, rtol=0, atol=1e-6, msg=name)
