"""GGUF's 5-bit and K-quant tensor types: `dequantize` bit for bit against gguf's reference dequantiser, on
random and edge-case blocks, a tiny Q4_K_M-style model through the loader, and a clear error for the rest."""
from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.gguf_dequant import F16_FIELDS, random_blocks
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import CHUNK_VALUES, FAST_DEQUANTIZERS, GGUFFile, dequantize
from engine.model.gguf_loader import read_gguf, read_gguf_lazily
from tests.test_gguf_loader import VOCAB, add_tokenizer, llama_cpp_permute

Q = gguf.GGMLQuantizationType
NEW_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", *NEW_TYPES)
F16 = np.float16
# Finite f16 scales of every kind: zeros of both signs, the smallest subnormal, the largest finite, and
# magnitudes a real model has.
FINITE_SCALES = np.array([0.0, -0.0, 2**-24, -2**-24, 6.1e-5, 1e-3, -1e-3, 0.5, 1.0, -2.0, 65504.0, -65504.0],
                         dtype=F16)
# Non-finite ones too: gguf computes with the same float32 operations in the same order, so even nan payloads
# come out the same.
NAN_PAYLOADS = np.array([0x7C01, 0x7E00, 0xFFFF, 0xFD55], dtype=np.uint16).view(F16)
ALL_SCALES = np.concatenate([FINITE_SCALES, np.array([np.inf, -np.inf], dtype=F16), NAN_PAYLOADS])
# Quant bytes that put every field at its minimum, its maximum, or alternate bits.
FILL_BYTES = (0x00, 0xFF, 0x55, 0xAA, 0x0F, 0xF0, 0x80, 0x7F, 0x01, 0xFE)


def reference(data: np.ndarray, qtype: Q) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 and the like, on the non-finite scales
        return np.ascontiguousarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def assert_bit_identical(data: np.ndarray, qtype: Q) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ours = dequantize(data, qtype)
    theirs = reference(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), qtype.name
    assert ours.flags.writeable and not np.shares_memory(ours, data)
    return ours


def blocks_per_chunk(qtype: Q) -> int:
    return CHUNK_VALUES // gguf.GGML_QUANT_SIZES[qtype][0]


def test_every_listed_type_has_a_fast_path() -> None:
    assert {Q[name] for name in (*BLOCK_TYPES, "F32", "F16", "BF16")} == set(FAST_DEQUANTIZERS)
    assert set(F16_FIELDS) == {Q[name] for name in BLOCK_TYPES}


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows, row_blocks", [(1, 1), (3, 5), (7, 1), (1, 2 * 1024 + 3)])
def test_random_blocks_with_finite_scales_are_bit_identical(qtype: str, rows: int, row_blocks: int) -> None:
    """The last shape spans two chunks and a part for the K-quants."""
    rng = np.random.default_rng(rows * 1000 + row_blocks)
    data = random_blocks(rng, Q[qtype], rows * row_blocks, FINITE_SCALES).reshape(rows, -1)
    block_size = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    assert assert_bit_identical(data, Q[qtype]).shape == (rows, row_blocks * block_size)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_random_blocks_with_any_scales_are_bit_identical(qtype: str) -> None:
    rng = np.random.default_rng(7)
    n_blocks = blocks_per_chunk(Q[qtype]) + 11
    assert_bit_identical(random_blocks(rng, Q[qtype], n_blocks, ALL_SCALES), Q[qtype])


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_edge_case_blocks_are_bit_identical(qtype: str) -> None:
    """Every quant byte set to each of FILL_BYTES, under every pair of extreme scales (d with dmin or m)."""
    _, type_size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    fields = F16_FIELDS[Q[qtype]]
    scale_sets = np.stack(np.meshgrid(*[ALL_SCALES] * len(fields), indexing="ij"), axis=-1).reshape(-1, len(fields))
    blocks = np.repeat(np.array(FILL_BYTES, dtype=np.uint8), len(scale_sets))[:, None].repeat(type_size, axis=1)
    for column, at in enumerate(fields):
        blocks[:, at:at + 2] = np.tile(scale_sets[:, column], len(FILL_BYTES))[:, None].view(np.uint8)
    values = assert_bit_identical(blocks, Q[qtype])
    assert np.isfinite(values).any() and np.isnan(values).any()


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_gguf_quantised_weights_dequantise_close_and_bit_identical(qtype: str) -> None:
    w = np.random.default_rng(3).standard_normal((40, 96)).astype(np.float32)
    values = assert_bit_identical(gguf.quants.quantize(w, Q[qtype]), Q[qtype])
    assert values.shape == w.shape and np.abs(values - w).max() < 0.25


def test_higher_dimensional_tensors_keep_their_leading_shape() -> None:
    data = random_blocks(np.random.default_rng(4), Q.Q4_K, 2 * 3 * 2, FINITE_SCALES).reshape(2, 3, -1)
    assert assert_bit_identical(data, Q.Q4_K).shape == (2, 3, 512)


# --- a tiny Llama in the mix of types a Q4_K_M / Q5_K_M download holds ------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2  # rows of 256: the K-quants' super-block
HEAD_DIM = HIDDEN // HEADS
SHAPES = {
    "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
}
MIXED_TYPES = {  # every block type at least once, K-quants where llama.cpp's Q4_K_M puts them
    "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q3_K, "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q5_0,
    "blk.0.ffn_down.weight": Q.Q5_1,
    "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_K, "blk.1.attn_v.weight": Q.Q6_K,
    "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q6_K,
}
QUANTISED_BY_GGUF = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})  # gguf writes no K-quants


def tensor_shape(name: str) -> tuple[int, ...]:
    if name.startswith(("token_embd.", "output.")):
        return (VOCAB, HIDDEN)
    return SHAPES[name.split(".")[2]]


def quantised_bytes(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """`qtype` data for a tensor of `shape`: gguf's own quantiser where it has one, else random blocks with
    scales of the size a real model's have (zeros for the types without a fast path)."""
    if qtype not in F16_FIELDS:
        return np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
    if qtype in QUANTISED_BY_GGUF:
        return gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), qtype)
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    scales = (rng.uniform(1e-4, 1e-2, 256) * rng.choice([-1, 1], 256)).astype(F16)
    blocks = random_blocks(rng, qtype, int(np.prod(shape)) // block_size, scales)
    return blocks.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype))


def write_mixed_gguf(path: Path, types: dict[str, Q]) -> None:
    """A tiny Llama whose matrices have `types` (F32 norms); raw blocks go in as they would from llama.cpp."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in {"block_count": LAYERS, "context_length": 256, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    add_tokenizer(writer, path.parent / "tok")
    for name, qtype in types.items():
        shape = tensor_shape(name)
        writer.add_tensor(name, quantised_bytes(rng, shape, qtype),
                          raw_shape=gguf.quants.quant_shape_to_byte_shape(shape, qtype), raw_dtype=qtype)
    for norm in ("output_norm.weight", *(f"blk.{i}.{part}.weight" for i in range(LAYERS)
                                          for part in ("attn_norm", "ffn_norm"))):
        writer.add_tensor(norm, rng.standard_normal(HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_name(gguf_name: str) -> str:
    parts = {"token_embd": "model.embed_tokens", "output": "lm_head", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    pieces = gguf_name.split(".")
    if pieces[0] == "blk":
        return f"model.layers.{pieces[1]}.{parts[pieces[2]]}.weight"
    return f"{parts[pieces[0]]}.weight"


def test_q4_k_m_style_model_loads_with_gguf_reference_weights(tmp_path: Path) -> None:
    write_mixed_gguf(tmp_path / "m.gguf", MIXED_TYPES)
    file = GGUFFile(tmp_path / "m.gguf")
    assert {info.name: info.ggml_type for info in file.tensors if info.ggml_type != Q.F32} == MIXED_TYPES
    assert set(MIXED_TYPES.values()) == {Q[name] for name in BLOCK_TYPES}
    model = read_gguf(tmp_path / "m.gguf")
    assert (model.config.hidden_size, model.config.num_layers) == (HIDDEN, LAYERS)
    assert len(model.weights) == len(MIXED_TYPES) + 1 + 2 * LAYERS
    for tensor in gguf.GGUFReader(tmp_path / "m.gguf").tensors:
        if tensor.name not in MIXED_TYPES:
            continue
        ours = model.weights[hf_name(tensor.name)].numpy()
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:  # the loader undoes llama.cpp's permutation
            ours = llama_cpp_permute(ours, HEADS if ".attn_q." in tensor.name else KV_HEADS)
        theirs = reference(tensor.data, tensor.tensor_type)
        assert ours.shape == theirs.shape == tensor_shape(tensor.name), tensor.name
        assert np.array_equal(np.ascontiguousarray(ours).view(np.uint32), theirs.view(np.uint32)), tensor.name


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ3_S", "IQ1_M", "TQ2_0", "MXFP4"])
def test_other_types_raise_an_error_naming_type_and_tensor(tmp_path: Path, qtype: str) -> None:
    """Raised with the header, before the weights are asked for (and so before any tensor is dequantised)."""
    write_mixed_gguf(tmp_path / "m.gguf", MIXED_TYPES | {"blk.1.ffn_up.weight": Q[qtype]})
    with pytest.raises(ModelLoadError, match=rf"tensor blk\.1\.ffn_up\.weight has type {qtype}, which is not "
                                             r"supported; expected one of BF16, F16, F32, Q2_K, .*Q8_0$"):
        read_gguf_lazily(tmp_path / "m.gguf")
