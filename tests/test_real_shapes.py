"""bench/real_shapes.py and its quantisers (bench/gguf_quant.py): the quantisers against `gguf`'s own (bytes) and
its dequantiser (values within each type's error bound), llama.cpp's Q4_K_M type rule, and tiny checkpoints written
by the tool's own code path loaded by the engine in every format."""
from __future__ import annotations

import io
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench import real_shapes
from bench.gguf_quant import quantize
from bench.real_shapes import (FORMATS, LLAMA3_ROPE, SHAPES, Shape, generate, gguf_type, llama_cpp_permute, main,
                               output_path, tensor_specs, use_more_bits)
from engine import LLM, SamplingParams
from engine.model.gguf_file import GGUFFile
from engine.model.gguf_loader import read_gguf
from engine.model.hf_loader import iter_hf_weights
from engine.model.loader import resolve_model
from engine.model.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
BASE_VOCAB = 49152  # the default model's tokenizer, which the tool pads
# the smallest shapes the K-quants take (rows of 256), with a vocabulary a little past the tokenizer's
TINY_LLAMA = Shape("tiny-llama", "llama", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=BASE_VOCAB + 64, tied=True, context=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                   rope_scaling=LLAMA3_ROPE)
TINY_QWEN2 = Shape("tiny-qwen2", "qwen2", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                   vocab=BASE_VOCAB + 32, tied=False, context=1024, rope_theta=1000000.0, rms_norm_eps=1e-6)
GGUF_FORMATS = ("bf16", "q8_0", "q4_0", "q4_k_m")


def sample_rows(rng: np.random.Generator, k: int = 1024) -> np.ndarray:
    """Rows a quantiser must handle: Gaussian at a weight's scale and at a large one, a heavy tail, a row of zeros,
    a constant positive row (Q4_K's minimum clamps to 0), one value among zeros, and a negative peak."""
    rows = [rng.standard_normal(k) * 0.02, rng.standard_normal(k) * 40, rng.standard_t(2, k), np.zeros(k),
            np.full(k, 0.75), np.eye(1, k, 17)[0] * 3, -np.abs(rng.standard_normal(k))]
    return np.stack(rows).astype(np.float32)


def ulp_bound(x: np.ndarray) -> np.ndarray:
    return np.abs(x) * 2.0**-8  # bf16 keeps 8 significant bits: half an ulp is at most 2^-8 of the value


def q8_0_bound(x: np.ndarray) -> np.ndarray:
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127  # half a step, and d's rounding to fp16
    return np.broadcast_to(0.6 * d, (d.shape[0], 32)).reshape(x.shape)


def q4_0_bound(x: np.ndarray) -> np.ndarray:
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 8  # the peak's opposite clamps to 7 d: one step
    return np.broadcast_to(1.05 * d, (d.shape[0], 32)).reshape(x.shape)


def q4_k_bound(x: np.ndarray) -> np.ndarray:
    """Half of a sub-block's step (max - min(lowest, 0)) / 15, plus what rounding the step and the minimum to 6
    bits of the super-block's largest (63 levels) can add over 15 codes: 9 of its steps, one of its minimums."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / 15
    coarse = 9 * step.max(axis=1, keepdims=True) / 63 + (-low).max(axis=1, keepdims=True) / 63
    return np.broadcast_to((step / 2 + coarse)[..., None], sub.shape).reshape(x.shape)


def q6_k_bound(x: np.ndarray) -> np.ndarray:
    """A sub-block's step (its peak / 32: the peak's opposite clamps to 31 steps), plus 33 times half the 8-bit
    scale's step (the largest step / 128) and its fp16 rounding."""
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 32
    coarse = 19 * step.max(axis=1, keepdims=True) / 128
    return np.broadcast_to((step + coarse)[..., None], sub.shape).reshape(x.shape)


BOUNDS = {Q.BF16: (ulp_bound, 0.003), Q.Q8_0: (q8_0_bound, 0.01), Q.Q4_0: (q4_0_bound, 0.1),
          Q.Q4_K: (q4_k_bound, 0.1), Q.Q6_K: (q6_k_bound, 0.03)}  # bound, and RMS error / RMS on Gaussian rows


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0])
def test_bytes_equal_gguf_quantiser(qtype: Q) -> None:
    x = sample_rows(np.random.default_rng(1))
    ours = quantize(x, qtype)
    assert ours.dtype == np.uint8 and ours.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
    assert np.array_equal(ours, gguf.quants.quantize(x, qtype))


@pytest.mark.unit
@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda q: q.name)
def test_dequantised_values_within_the_type_bound(qtype: Q) -> None:
    x = sample_rows(np.random.default_rng(2))
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    bound, rms = BOUNDS[qtype]
    assert back.shape == x.shape and np.isfinite(back).all()
    excess = np.abs(back - x) - bound(x)
    assert excess.max() <= 0, f"{qtype.name}: {int((excess > 0).sum())} values past the bound"
    assert not back[3].any() and not back[5][x[5] == 0].any()  # zeros stay zeros, beside a peak too
    gaussian = x[0]
    assert np.sqrt(np.mean((back[0] - gaussian) ** 2)) < rms * np.sqrt(np.mean(gaussian ** 2))


@pytest.mark.unit
def test_k_quant_codes_use_the_whole_range() -> None:
    """A layout error that kept values within bounds by luck would still show as unused codes."""
    x = np.random.default_rng(3).standard_normal((8, 4096)).astype(np.float32)
    q4 = quantize(x, Q.Q4_K).reshape(-1, 144)[:, 16:]
    q6 = quantize(x, Q.Q6_K).reshape(-1, 210)
    assert set(np.concatenate([q4 & 15, q4 >> 4]).ravel()) == set(range(16))
    codes = np.concatenate([q6[:, :128] & 15, q6[:, :128] >> 4]).ravel()
    assert set(codes) == set(range(16)) and set((q6[:, 128:192] >> 6).ravel()) == set(range(4))


@pytest.mark.unit
def test_quantize_refuses_rows_that_do_not_split_into_blocks() -> None:
    with pytest.raises(ValueError, match="rows of 320 values do not split into Q4_K blocks of 256"):
        quantize(np.zeros((2, 320), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="no quantiser for Q5_K"):
        quantize(np.zeros((2, 256), np.float32), Q.Q5_K)


# ---------------------------------------------------------------- the shapes and llama.cpp's type choices


@pytest.mark.unit
def test_q4_k_m_types_follow_llama_cpp() -> None:
    """Llama-3.2-1B (16 layers, tied) and Llama-3.1-8B (32 layers, untied) as llama-quantize types them."""
    one_b, eight_b = SHAPES["llama-3.2-1b"], SHAPES["llama-3.1-8b"]
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    types = {s.gguf: gguf_type("q4_k_m", s, one_b) for s in tensor_specs(one_b)}
    six = {name for name, t in types.items() if t == Q.Q6_K}
    assert six == {"token_embd.weight"} | {f"blk.{i}.{p}.weight" for i in (0, 1, 4, 7, 10, 13, 14, 15)
                                           for p in ("attn_v", "ffn_down")}
    assert {t for name, t in types.items() if "norm" in name} == {Q.F32}
    assert set(types.values()) == {Q.Q4_K, Q.Q6_K, Q.F32}
    untied = {s.gguf: gguf_type("q4_k_m", s, eight_b) for s in tensor_specs(eight_b)}
    assert (untied["output.weight"], untied["token_embd.weight"]) == (Q.Q6_K, Q.Q4_K)
    q4_0 = {gguf_type("q4_0", s, one_b) for s in tensor_specs(one_b) if s.gguf != "token_embd.weight"}
    assert q4_0 == {Q.Q4_0, Q.F32} and gguf_type("q4_0", tensor_specs(one_b)[0], one_b) == Q.Q6_K


@pytest.mark.unit
def test_real_shapes_have_their_published_sizes() -> None:
    """Parameter counts of the published models (embedding counted once where tied)."""
    counts = {name: sum(int(np.prod(s.dims)) for s in tensor_specs(shape)) for name, shape in SHAPES.items()}
    assert counts == {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
                      "llama-3.1-8b": 8_030_261_248, "qwen2.5-1.5b": 1_543_714_304}


@pytest.mark.unit
def test_bad_shape_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="shape odd: sizes .* heads not a multiple of KV heads"):
        Shape("odd", "llama", layers=1, hidden=64, intermediate=64, heads=3, kv_heads=2, head_dim=16, vocab=10,
              tied=True, context=8, rope_theta=1.0, rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match="model_type 'gpt2'; expected llama or qwen2"):
        Shape("gpt", "gpt2", layers=1, hidden=64, intermediate=64, heads=2, kv_heads=2, head_dim=32, vocab=10,
              tied=True, context=8, rope_theta=1.0, rms_norm_eps=1e-5)


# ---------------------------------------------------------------- writing: atomic, kept, the CLI


@pytest.mark.unit
def test_a_shape_the_types_cannot_hold_is_refused_before_writing(tmp_path: Path) -> None:
    bad = Shape("bad", "llama", layers=1, hidden=96, intermediate=256, heads=2, kv_heads=2, head_dim=48,
                vocab=BASE_VOCAB, tied=True, context=64, rope_theta=1e4, rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match="bad: token_embd.weight has rows of 96 values, which do not split into "
                                         "Q6_K blocks of 256"):
        generate(bad, "bad", "q4_k_m", tmp_path, stream=io.StringIO())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["q8_0", "safetensors"])
def test_a_write_that_fails_midway_leaves_nothing(tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def failing(spec, seed):
        calls.append(spec.hf)
        if len(calls) == 3:
            raise OSError("disk full")
        return np.zeros(spec.dims, np.float32)

    monkeypatch.setattr(real_shapes, "tensor_values", failing)
    stream = io.StringIO()
    with pytest.raises(OSError, match="disk full"):
        generate(TINY_LLAMA, "tiny", fmt, tmp_path, stream=stream)
    assert list(tmp_path.iterdir()) == [] and "tensor 2/" in stream.getvalue()


@pytest.mark.unit
def test_an_existing_checkpoint_is_kept(tmp_path: Path) -> None:
    kept = output_path(tmp_path, "tiny", "q4_k_m")
    kept.write_bytes(b"placeholder")
    stream = io.StringIO()
    assert generate(TINY_LLAMA, "tiny", "q4_k_m", tmp_path, stream=stream) == kept
    assert kept.read_bytes() == b"placeholder" and "exists; kept" in stream.getvalue()


@pytest.mark.unit
def test_cli_prints_the_paths_and_names_bad_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = [output_path(tmp_path, "llama-3.2-1b", f) for f in ("q4_k_m", "safetensors")]
    for path in paths:  # present already, so nothing is generated
        path.mkdir() if path.suffix != ".gguf" else path.write_bytes(b"")
    main(["--shape", "llama-3.2-1b", "--format", "q4_k_m,safetensors", "--out", str(tmp_path)])
    assert capsys.readouterr().out.split() == [str(p) for p in paths]
    with pytest.raises(SystemExit):
        main(["--shape", "llama-3.2-1b,llama-9b", "--format", "q4_k_m", "--out", str(tmp_path)])
    assert "unknown shape llama-9b; expected a comma-separated list of llama-3.2-1b" in capsys.readouterr().err


# ---------------------------------------------------------------- tiny checkpoints through the engine


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("real-shapes")
    return {fmt: generate(TINY_LLAMA, "tiny", fmt, out, seed=5, stream=io.StringIO()) for fmt in FORMATS}


def generate_ids(path: Path) -> list[int]:
    """Six greedy tokens. The shipped kernel table: these tests are of loading, and a measured one would time the
    kernels for every format (3 s for Q4_0's Q6_K head); tests/test_dispatch.py tests the measurement."""
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=64, kernel_dispatch="shipped")
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiny_checkpoint_loads_and_generates(tiny_llama: dict[str, Path], fmt: str) -> None:
    source = resolve_model(tiny_llama[fmt])
    config = source.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (2, 256, 512, 4, 2, 64, TINY_LLAMA.vocab)
    assert config.tie_word_embeddings and config.rope_theta == 500000.0
    assert config.rope_scaling is not None and (config.rope_scaling.kind, config.rope_scaling.factor) == ("llama3", 32)
    assert source.tokenizer.vocab_size == TINY_LLAMA.vocab
    if fmt != "safetensors":
        file = GGUFFile(tiny_llama[fmt])
        written = {t.name: t.ggml_type for t in file.tensors if t.name != "rope_freqs.weight"}
        assert written == {s.gguf: gguf_type(fmt, s, TINY_LLAMA) for s in tensor_specs(TINY_LLAMA)}
        assert file.metadata["general.file_type"] == FORMATS[fmt].file_type
    ids = generate_ids(tiny_llama[fmt])
    assert len(ids) == 6 and all(0 <= i < TINY_LLAMA.vocab for i in ids)


def test_bf16_gguf_and_folder_hold_the_same_model(tiny_llama: dict[str, Path]) -> None:
    """The same weights (Q/K permuted in the file, un-permuted by the loader), so the same greedy tokens."""
    assert generate_ids(tiny_llama["bf16"]) == generate_ids(tiny_llama["safetensors"])


def test_gguf_weights_are_the_folders_rounded(tiny_llama: dict[str, Path]) -> None:
    """BF16 holds exactly the folder's values, Q8_0 them within its rounding (bf16's and Q8_0's half steps at these
    weights' peak, 0.1), Q and K rows in llama.cpp's order in the file and Hugging Face's once loaded."""
    folder = {name: w.float() for name, w in iter_hf_weights(tiny_llama["safetensors"])}
    bf16, q8 = read_gguf(tiny_llama["bf16"]).weights, read_gguf(tiny_llama["q8_0"]).weights
    assert bf16.keys() == q8.keys() == folder.keys()
    for name, w in folder.items():
        assert torch.equal(bf16[name], w), name
        torch.testing.assert_close(q8[name], w, atol=1e-3, rtol=0, msg=name)
    stored = GGUFFile(tiny_llama["bf16"])
    q_rows = next(t for t in stored.tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.quants.dequantize(stored.tensor_data(q_rows), q_rows.ggml_type)
    assert np.array_equal(raw, llama_cpp_permute(folder["model.layers.0.self_attn.q_proj.weight"].numpy(), 4))


def test_folder_tokenizer_is_the_gguf_one_padded(tiny_llama: dict[str, Path]) -> None:
    folder = Tokenizer.from_hf_folder(tiny_llama["safetensors"])
    packed = resolve_model(tiny_llama["q4_k_m"]).tokenizer
    text = "Hello world, 12345 <|im_start|>user\nhi<|im_end|>"
    assert folder.encode(text) == packed.encode(text) and folder.vocab_size == packed.vocab_size == TINY_LLAMA.vocab
    assert folder.id_to_token(TINY_LLAMA.vocab - 1) == f"[PAD{TINY_LLAMA.vocab - 1}]"
    assert folder.eos_token_ids == packed.eos_token_ids and folder.chat_template == packed.chat_template


@pytest.mark.parametrize("fmt", ["safetensors", "q8_0"])
def test_tiny_qwen2_with_biases_loads_and_generates(tmp_path: Path, fmt: str) -> None:
    path = generate(TINY_QWEN2, "tiny-qwen2", fmt, tmp_path, stream=io.StringIO())
    source = resolve_model(path)
    assert source.config.architecture == "qwen2" and source.config.attention_bias
    assert not source.config.tie_word_embeddings and "model.layers.1.self_attn.v_proj.bias" in source.shapes()
    assert len(generate_ids(path)) == 6
