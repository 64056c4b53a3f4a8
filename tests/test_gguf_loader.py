"""GGUF loading: tiny synthetic files for each code path, and the default model against transformers."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch

from engine.config import RopeScaling
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFFile, TensorInfo, dequantize
from engine.model.gguf_loader import default_model_path, read_gguf
from engine.model.rope import inverse_frequencies
from engine.model.tokenizer import Tokenizer
from tests.tiny_tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 300
HEAD_DIM = HIDDEN // HEADS
LAYER_SHAPES = {
    "attn_q": ("self_attn.q_proj", (HIDDEN, HIDDEN)), "attn_k": ("self_attn.k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_v": ("self_attn.v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "attn_output": ("self_attn.o_proj", (HIDDEN, HIDDEN)),
    "ffn_gate": ("mlp.gate_proj", (FFN, HIDDEN)), "ffn_up": ("mlp.up_proj", (FFN, HIDDEN)),
    "ffn_down": ("mlp.down_proj", (HIDDEN, FFN)), "attn_norm": ("input_layernorm", (HIDDEN,)),
    "ffn_norm": ("post_attention_layernorm", (HIDDEN,)),
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows of llama models."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tensors(arch: str, untied: bool, biases: bool, seed: int = 0,
                 vocab: int = VOCAB) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (Hugging Face name, float32 weight) for a tiny random model."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": ("model.embed_tokens.weight", w(vocab, HIDDEN)),
               "output_norm.weight": ("model.norm.weight", w(HIDDEN))}
    if untied:
        tensors["output.weight"] = ("lm_head.weight", w(vocab, HIDDEN))
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
    merges = spec["model"]["merges"]
    writer.add_array("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_uint32("tokenizer.ggml.eos_token_id", vocab["<|im_end|>"])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", CHATML_TEMPLATE)


def write_gguf(path: Path, arch: str = "llama", qtype: Q = Q.F32, untied: bool = False, biases: bool = False,
               extra: dict[str, float | str] | None = None, rope_factors: np.ndarray | None = None,
               tokenizer_model: str = "gpt2", tokenizer: Callable[[gguf.GGUFWriter], int] | None = None,
               ) -> dict[str, np.ndarray]:
    """Writes a tiny model as llama.cpp would; returns its weights under Hugging Face names.

    `tokenizer`, when given, writes the tokenizer metadata in place of the tiny byte-level one and returns the
    vocabulary size, which the embedding takes.
    """
    writer = gguf.GGUFWriter(path, arch)
    vocab = VOCAB if tokenizer is None else tokenizer(writer)
    tensors = tiny_tensors(arch, untied, biases, vocab=vocab)
    for key, value in {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    for key, value in (extra or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    if tokenizer is None:
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


@pytest.mark.parametrize("qtype, tolerance", [("F16", 2e-3), ("BF16", 2e-2), ("Q8_0", 0.05), ("Q4_0", 0.6),
                                              ("Q4_1", 0.6)])
def test_tiny_quantised_weights_dequantise(tmp_path: Path, qtype: str, tolerance: float) -> None:
    expected = write_gguf(tmp_path / "m.gguf", qtype=Q[qtype])
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
    ({"qtype": Q.MXFP4}, "MXFP4"),
    ({"arch": "gemma"}, "'gemma'"),
    ({"extra": {"llama.rope.scaling.type": "yarn"}}, "yarn"),
    ({"tokenizer_model": "t5"}, "'t5'"),
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
def transformers_state_dict(hf_gguf_model) -> dict[str, torch.Tensor]:
    return hf_gguf_model.state_dict()


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
        torch.testing.assert_close(default_model.weights[name], tensor, rtol=0, atol=0, msg=name)


# --- the GGUF parser and dequantisation against the gguf package --------------------------------------------

V = gguf.GGUFValueType
FAST_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SCALARS = {"t.u8": (255, V.UINT8), "t.i8": (-128, V.INT8), "t.u16": (65535, V.UINT16), "t.i16": (-32768, V.INT16),
           "t.u32": (2**32 - 1, V.UINT32), "t.i32": (-2**31, V.INT32), "t.u64": (2**64 - 1, V.UINT64),
           "t.i64": (-2**63, V.INT64), "t.f32": (1.5, V.FLOAT32), "t.f64": (0.1, V.FLOAT64), "t.bool": (True, V.BOOL),
           "t.str": ("héllo 😀", V.STRING), "t.empty": ("", V.STRING)}
ARRAYS = {"t.a_i64": ([1, -2, 2**40], V.INT64), "t.a_u8": ([0, 7, 255], V.UINT8), "t.a_f32": ([0.5, -2.0], V.FLOAT32),
          "t.a_f64": ([0.1, 1e300], V.FLOAT64), "t.a_bool": ([True, False], V.BOOL),
          "t.a_str": (["", "a b", "日本語", "x" * 1000], V.STRING)}


def reader_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def assert_parsed_like_gguf_reader(path: Path) -> tuple[GGUFFile, gguf.GGUFReader]:
    ours, reader = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.metadata.items()) == list(reader_metadata(reader).items())
    assert (ours.version, ours.data_offset) == (reader.fields["GGUF.version"].contents(), reader.data_offset)
    assert [info.name for info in ours.tensors] == [t.name for t in reader.tensors]
    for info, theirs in zip(ours.tensors, reader.tensors):
        assert info == TensorInfo(theirs.name, tuple(reversed(theirs.shape.tolist())), theirs.tensor_type,
                                  theirs.data_offset, theirs.n_bytes)
        assert info.n_elements == theirs.n_elements
        data = ours.tensor_data(info)
        assert (data.dtype, data.shape) == (theirs.data.dtype, theirs.data.shape), info.name
        assert data.tobytes() == theirs.data.tobytes() and not data.flags.writeable, info.name
    return ours, reader


def write_metadata_gguf(path: Path, alignment: int = 64) -> None:
    """Every metadata value type, a custom alignment and tensors whose sizes need padding."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    for key, (values, kind) in ARRAYS.items():
        writer.add_key_value(key, values, V.ARRAY, sub_type=kind)
    writer.add_tensor("a", np.arange(15, dtype=np.float32).reshape(3, 5))
    writer.add_tensor("b", np.arange(7, dtype=np.float16))
    writer.add_tensor("c", np.arange(-3, 3, dtype=np.int32).reshape(2, 1, 3))
    w = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    writer.add_tensor("d", gguf.quants.quantize(w, Q.Q8_0), raw_shape=gguf.quants.quant_shape_to_byte_shape(
        w.shape, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [*FAST_TYPES, "Q5_0"])
def test_parser_matches_gguf_reader_on_tiny_models(tmp_path: Path, qtype: str) -> None:
    write_gguf(tmp_path / "m.gguf", qtype=Q[qtype], untied=True, biases=True,
               extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
               rope_factors=np.linspace(1, 8, HEAD_DIM // 2))
    assert_parsed_like_gguf_reader(tmp_path / "m.gguf")


def test_parser_reads_every_value_type_and_custom_alignment(tmp_path: Path) -> None:
    write_metadata_gguf(tmp_path / "m.gguf", alignment=64)
    ours, _ = assert_parsed_like_gguf_reader(tmp_path / "m.gguf")
    expected = {key: value for key, (value, _) in (SCALARS | ARRAYS).items()}
    assert {key: ours.metadata[key] for key in expected} == {**expected, "t.f64": 0.1}
    assert ours.alignment == 64 and ours.data_offset % 64 == 0
    assert all((info.offset - ours.data_offset) % 64 == 0 for info in ours.tensors)
    assert ours.tensor_data(ours.tensors[2]).tolist() == [[[-3, -2, -1]], [[0, 1, 2]]]


def test_parser_reads_nested_arrays_as_lists_of_lists(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_key_value("t.nested", [[1, 2], [3], ["x"]], V.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert GGUFFile(tmp_path / "m.gguf").metadata["t.nested"] == [[1, 2], [3], ["x"]]


def quantised(w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w` stored as `qtype`, shaped as GGUFFile.tensor_data (and gguf.GGUFReader) give it."""
    return gguf.quants.quantize(w, qtype)


def random_blocks(rng: np.random.Generator, rows: int, blocks_per_row: int, qtype: Q) -> np.ndarray:
    """Arbitrary quantised bytes, every block's float16 scale (and Q4_1 minimum) finite: zeros, subnormals, big."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    n_scales = 2 if qtype == Q.Q4_1 else 1
    magnitudes = rng.choice([0.0, 1e-7, 1e-3, 1.0, 6e4], size=(rows, blocks_per_row, n_scales))
    scales = np.clip(rng.standard_normal(magnitudes.shape) * magnitudes, -6e4, 6e4).astype(np.float16)
    data[..., :2 * n_scales] = scales.view(np.uint8)
    return data.reshape(rows, -1)


def assert_bit_identical(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> None:
    ours, theirs = dequantize(data, qtype), gguf.quants.dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == tuple(theirs.shape) == shape
    assert ours.tobytes() == np.ascontiguousarray(theirs, dtype=np.float32).tobytes()
    assert ours.flags.writeable and not np.shares_memory(ours, data)


@pytest.mark.parametrize("qtype", FAST_TYPES)
@pytest.mark.parametrize("shape", [(64,), (37, 96), (2, 3, 64), (300, 1024)])  # the last spans several chunks
def test_dequantize_is_bit_identical_to_gguf(qtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(len(shape))
    w = rng.standard_normal(shape) * rng.choice([0.0, 1e-6, 1.0, 1e3], size=shape[:-1] + (1,))
    w = w.astype(np.float32)
    if qtype in ("F32", "F16", "BF16"):
        w.flat[:5] = [np.inf, -np.inf, np.nan, -0.0, 1e-40]
    assert_bit_identical(quantised(w, Q[qtype]), Q[qtype], shape)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_arbitrary_blocks_bit_identical_to_gguf(qtype: str) -> None:
    data = random_blocks(np.random.default_rng(1), 270, 40, Q[qtype])
    assert_bit_identical(data, Q[qtype], (270, 40 * 32))


def test_dequantize_falls_back_to_gguf_for_other_types() -> None:
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    assert_bit_identical(quantised(w, Q.MXFP4), Q.MXFP4, (4, 64))


@pytest.mark.slow
def test_default_model_parses_and_dequantises_like_gguf() -> None:
    ours, _ = assert_parsed_like_gguf_reader(default_model_path())
    by_type: dict[Q, list[TensorInfo]] = {}
    for info in ours.tensors:
        by_type.setdefault(info.ggml_type, []).append(info)
    assert set(by_type) == {Q.F32, Q.Q8_0, Q.Q4_1}
    for infos in by_type.values():
        for info in infos[:3]:
            assert_bit_identical(ours.tensor_data(info), info.ggml_type, info.shape)


def test_truncated_files_raise_model_load_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    whole = (tmp_path / "m.gguf").read_bytes()
    data_offset = GGUFFile(tmp_path / "m.gguf").data_offset
    for cut in [*range(4, data_offset, 97), data_offset - 1, data_offset + 1, len(whole) - 1]:
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            GGUFFile(tmp_path / "cut.gguf")
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf(tmp_path / "cut.gguf")


def patched(whole: bytes, at: int, new: bytes) -> bytes:
    return whole[:at] + new + whole[at + len(new):]


def value_offset(whole: bytes, key: str) -> int:
    """Where a metadata key's value type sits (its value follows)."""
    return whole.index(key.encode()) + len(key)


def tensor_type_offset(whole: bytes, name: str) -> int:
    at = whole.index(name.encode()) + len(name)
    return at + 4 + 8 * struct.unpack_from("<I", whole, at)[0]


@pytest.mark.parametrize("corrupt, expected", [
    (lambda b: b"", "could not be read"),
    (lambda b: b[:2], "not a GGUF file"),
    (lambda b: patched(b, 0, b"GGML"), "not a GGUF file"),
    (lambda b: patched(b, 4, struct.pack("<I", 1)), "version 1"),
    (lambda b: patched(b, 4, struct.pack(">I", 3)), "big-endian"),
    (lambda b: patched(b, value_offset(b, "general.architecture"), struct.pack("<I", 99)), "value type 99"),
    (lambda b: patched(b, value_offset(b, "tokenizer.ggml.tokens") + 8, struct.pack("<Q", 2**60)), "truncated"),
    (lambda b: patched(b, tensor_type_offset(b, "token_embd.weight"), struct.pack("<I", 1000)), "ggml type 1000"),
    (lambda b: patched(b, b.index(b"llama.context_length"), b"llama.rope.freq_base"), "repeats"),
])
def test_corrupt_files_raise_model_load_error(tmp_path: Path, corrupt, expected: str) -> None:
    write_gguf(tmp_path / "m.gguf")
    (tmp_path / "bad.gguf").write_bytes(corrupt((tmp_path / "m.gguf").read_bytes()))
    with pytest.raises(ModelLoadError, match=expected):
        GGUFFile(tmp_path / "bad.gguf")


def test_bad_alignment_raises_model_load_error(tmp_path: Path) -> None:
    write_metadata_gguf(tmp_path / "m.gguf", alignment=64)
    whole = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "bad.gguf").write_bytes(patched(whole, value_offset(whole, "general.alignment") + 4,
                                                struct.pack("<I", 48)))
    with pytest.raises(ModelLoadError, match="power of two"):
        GGUFFile(tmp_path / "bad.gguf")


def test_random_header_damage_only_ever_raises_model_load_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", qtype=Q.Q4_1)
    whole = bytearray((tmp_path / "m.gguf").read_bytes())
    header_end = GGUFFile(tmp_path / "m.gguf").data_offset
    rng = np.random.default_rng(3)
    for _ in range(200):
        damaged = bytearray(whole)
        for at in rng.integers(4, header_end, size=rng.integers(1, 4)):
            damaged[at] = rng.integers(0, 256)
        (tmp_path / "bad.gguf").write_bytes(damaged)
        try:
            GGUFFile(tmp_path / "bad.gguf")
        except ModelLoadError:
            pass
