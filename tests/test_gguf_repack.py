"""GGUF's 4-bit blocks repacked into the int4 format (engine/model/gguf_repack.py) without dequantising: the int4
weight dequantised (weight_ops.int4_rows) against gguf's own dequantiser, exactly for Q4_0 and Q4_1 and within the
fp16 rounding of Q4_K's d * sc and dmin * m; the CPU kernels' products on it against x W^T of the file's values;
and `auto` choosing per projection on a Q4_K_M-style file."""
from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bench.gguf_dequant import random_blocks
from engine.backends import weight_ops
from engine.kernels import cpu_ext
from engine.model import quant
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import k_scales_mins
from engine.model.gguf_loader import read_gguf_lazily
from engine.model.gguf_repack import REPACKERS, repack_int4
from engine.model.layers import Linear
from engine.model.loader import load_model, resolve_model
from tests import test_gguf_quants as mixed
from tests.kernel_helpers import require_kernels
from tests.test_gguf_loader import HEADS, KV_HEADS, llama_cpp_permute, write_gguf
from tests.test_weight_int4 import assert_rounded_once, quantize_activations

Q = gguf.GGMLQuantizationType
F16 = np.float16
# fp16 scales of the size a real model's have, of both signs, and subnormal ones (2^-24 steps)
SCALES = np.concatenate([(np.random.default_rng(0).uniform(1e-4, 2e-2, 64) * np.repeat([1, -1], 32)),
                         [2 ** -24, -2 ** -20, 6.0e-5, 0.0]]).astype(F16)


def reference(data: np.ndarray, qtype: Q) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def as_int4(data: np.ndarray, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, quant.Int4Rows]:
    """data's rows repacked and put in the int4 layout, as the model holds them: (packed, scales, the rows)."""
    repack = repack_int4(data, qtype)
    rows = quant.Int4Rows(torch.from_numpy(repack.codes.reshape(*repack.scale.shape, 4, 4)),
                          torch.from_numpy(repack.scale), torch.from_numpy(repack.offset))
    n, k = data.shape[0], repack.scale.shape[1] * weight_ops.INT4_GROUP
    codes, scales = weight_ops.int4_shapes(n, k)
    packed, table = torch.zeros(codes, dtype=torch.uint8), torch.zeros(scales, dtype=torch.float16)
    quant.store_int4(packed, table, 0, quant.FileBlocks((n, k), lambda: None, lambda: iter([(0, rows)])))
    return packed, table, rows


def int4_values(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    n, k = weight_ops.int4_channels(scales), scales.shape[1] * weight_ops.INT4_GROUP
    return weight_ops.int4_rows(packed, scales, torch.arange(n), k, torch.float32).numpy()


def test_the_repacked_types_are_those_auto_keeps_int4():
    assert {t.name for t in REPACKERS} - {"Q4_K"} == quant.EXACT_INT4_TYPES  # Q4_K's scales round to fp16


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("source", ["quantised", "random blocks"])
def test_q4_0_and_q4_1_repack_to_the_files_values_exactly(qtype, source):
    """gguf's own quantiser on random weights, and random bytes (every nibble, scales of both signs, subnormal
    and zero ones, Q4_1's m likewise): every value equal to gguf's (== : 8 d - 8 d is +0 where gguf's may be -0)."""
    rng = np.random.default_rng(1)
    if source == "quantised":
        data = gguf.quants.quantize((rng.standard_normal((37, 320)) * 0.05).astype(np.float32), Q[qtype])
    else:
        data = random_blocks(rng, Q[qtype], 37 * 10, SCALES).reshape(37, -1)
    packed, scales, _ = as_int4(data, Q[qtype])
    assert np.array_equal(int4_values(packed, scales), reference(data, Q[qtype]))
    assert repack_int4(data, Q[qtype])[3:] == (0, 0)  # neither rounded nor overflowed


def q4_k_exact_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's d * sc and -dmin * m per 32-value group [R, G], in float64 (exact)."""
    blocks = np.ascontiguousarray(data).reshape(-1, 144)
    sc, m = k_scales_mins(blocks[:, 4:16])
    d, dmin = (blocks[:, at:at + 2].view(F16).astype(np.float64) for at in (0, 2))
    return (d * sc).reshape(data.shape[0], -1), (-dmin * m).reshape(data.shape[0], -1)


def test_q4_k_repacks_within_the_fp16_rounding_of_its_scales():
    """Random valid blocks: s and z are d * sc and -dmin * m rounded to nearest fp16 (within its unit roundoff);
    each value within q |s - d sc| + |z + dmin m| (and one fp32 rounding) of gguf's; the groups whose s and z are
    exact give gguf's values bit for bit, and `inexact` counts the others."""
    rng = np.random.default_rng(2)
    data = random_blocks(rng, Q.Q4_K, 24 * 3, SCALES).reshape(24, -1)
    packed, scales, rows = as_int4(data, Q.Q4_K)
    exact_s, exact_z = q4_k_exact_parts(data)
    s, z = rows.scale.double().numpy(), rows.offset.double().numpy()
    for rounded, exact_value in ((s, exact_s), (z, exact_z)):  # fp16's unit roundoff 2^-11; subnormals 2^-25
        assert (np.abs(rounded - exact_value) <= np.maximum(np.abs(exact_value) * 2 ** -11, 2 ** -25)).all()
    got, ref = int4_values(packed, scales).reshape(24, -1, 32), reference(data, Q.Q4_K).reshape(24, -1, 32)
    q = weight_ops.unpack_int4(packed, torch.arange(24)).double().numpy().reshape(24, -1, 32)
    fp32_rounding = np.spacing(np.maximum(np.abs(got), np.abs(ref)))
    bound = q * np.abs(s - exact_s)[..., None] + np.abs(z - exact_z)[..., None] + fp32_rounding
    assert (np.abs(got.astype(np.float64) - ref) <= bound).all()
    exact = (s == exact_s) & (z == exact_z)
    assert 0 < exact.sum() < exact.size  # both kinds occur with these scales
    assert np.array_equal(got[exact], ref[exact])
    assert repack_int4(data, Q.Q4_K).inexact == (~exact).sum()


def test_q4_k_with_power_of_two_scales_repacks_exactly():
    """d and dmin powers of two: every d * sc and dmin * m fits fp16, so the nibbles' regrouping alone decides."""
    rng = np.random.default_rng(3)
    data = random_blocks(rng, Q.Q4_K, 16 * 4, (2.0 ** -np.arange(4, 12)).astype(F16)).reshape(16, -1)
    packed, scales, _ = as_int4(data, Q.Q4_K)
    assert np.array_equal(int4_values(packed, scales), reference(data, Q.Q4_K))
    assert repack_int4(data, Q.Q4_K)[3:] == (0, 0)


def test_other_types_have_no_repack():
    with pytest.raises(ValueError, match="GGUF type Q6_K has no int4 repack; expected one of Q4_0, Q4_1, Q4_K"):
        repack_int4(np.zeros((1, 210), dtype=np.uint8), Q.Q6_K)


# ---- the kernels' products on repacked weights ------------------------------------------------------------------


def repacked_case(qtype: Q, rows: int, n: int = 48, k: int = 512):
    """(x bf16 [rows, k], packed, scales, the file's weight [n, k] float64, |W_int4 - W_file| float64)."""
    rng = np.random.default_rng(rows + n)
    data = random_blocks(rng, qtype, n * k // gguf.GGML_QUANT_SIZES[qtype][0], SCALES[:64]).reshape(n, -1)
    packed, scales, _ = as_int4(data, qtype)
    file_w = torch.from_numpy(reference(data, qtype)).double()
    gap = (torch.from_numpy(int4_values(packed, scales)).double() - file_w).abs()
    x = torch.from_numpy(rng.standard_normal((rows, k))).to(torch.bfloat16)
    return x, packed, scales, file_w, gap


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_weight_only_kernel_is_the_files_product_rounded_once(qtype, rows):
    """linear_int4 (the shipped int4 path up to max_int4_rows) takes the bf16 activations whole, sums in fp32
    and rounds each output once to bf16: within one bf16 rounding (and the fp32 sums' error) of x W^T with the
    file's own W, plus |x| |W_int4 - W_file|^T for Q4_K's scale rounding (0 for Q4_0 / Q4_1)."""
    require_kernels()
    if not cpu_ext.int4_vectorized():
        pytest.skip("the weight-only int4 kernel was built without AVX2, FMA and F16C")
    x, packed, scales, file_w, gap = repacked_case(Q[qtype], rows)
    assert (gap == 0).all() == (qtype != "Q4_K")
    got = cpu_ext.linear_int4(x, packed, scales)
    ref = x.double() @ file_w.T
    slack = x.double().abs() @ gap.T
    assert ((got.double() - ref).abs() <= (ref.abs() + slack) * 2 ** -8 + slack
            + (x.double().abs() @ file_w.abs().T) * 2 ** -15).all()
    if qtype != "Q4_K":
        assert_rounded_once(got, ref, x, file_w, (rows, file_w.shape[0]), sum_error=2 ** -7)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_w4a8_kernel_is_the_files_product_within_its_activation_rounding(qtype):
    """W4A8 (off by default: max_w4a8_rows 0) rounds each group of 32 activations to int8 codes of step a =
    max |x| / 127 and multiplies them with the weights about their group's middle, s (q - 7.5) (the middle's own
    term takes the exact activation sums): each product moves by at most sum_g a_g / 2 sum |s (q - 7.5)| over
    the group, besides the fp32 sums, the bf16 output rounding and Q4_K's scale rounding."""
    require_kernels()
    if not cpu_ext.w4a8_vnni():
        pytest.skip("the W4A8 kernel was built without AVX-512 VNNI")
    x, packed, scales, file_w, gap = repacked_case(Q[qtype], 4)
    got = cpu_ext.linear_w4a8(x, packed, scales).double()
    ref = x.double() @ file_w.T
    _, a = quantize_activations(x)  # [rows, groups]
    n, groups = file_w.shape[0], a.shape[1]
    codes = weight_ops.unpack_int4(packed, torch.arange(n)).double().view(n, groups, 32)
    s = weight_ops.int4_scales_of(scales, torch.arange(n))[0].double()  # [n, groups]
    centred = (s.unsqueeze(2) * (codes - 7.5)).abs().sum(-1)
    slack = (a / 2) @ centred.T + x.double().abs() @ gap.T + (x.double().abs() @ file_w.abs().T) * 2 ** -15
    assert ((got - ref).abs() <= (ref.abs() + slack) * 2 ** -8 + slack).all()
    assert not ((got - ref).abs() <= (ref.abs() * 2 ** -8)).all()  # the activations' rounding does show


# ---- through the loader and `auto` ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_loaded_int4_weights_are_the_files_values(tmp_path, qtype):
    """Through the loader: q and k rows un-permuted as their float values are, the fused q|k|v and gate|up rows at
    their offsets, the tied embedding as the LM head: every int4 weight dequantises to gguf's values."""
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=qtype)
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="int4")
    stored = {t.name: reference(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    layer = model.layers[1]
    for module, names in [(layer.self_attn.qkv_proj, ("attn_q", "attn_k", "attn_v")),
                          (layer.mlp.gate_up_proj, ("ffn_gate", "ffn_up")), (layer.mlp.down_proj, ("ffn_down",))]:
        ours, first = int4_values(module.weight, module.weight_scale), 0
        for name in names:
            want = stored[f"blk.1.{name}.weight"]
            rows = ours[first:first + want.shape[0], :want.shape[1]]
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            assert np.array_equal(llama_cpp_permute(rows, heads) if heads else rows, want), name
            first += want.shape[0]
    head = model.head_module()
    assert np.array_equal(int4_values(head.weight, head.weight_scale), stored["token_embd.weight"])


def test_lazy_blocks_dequantise_as_read_gguf_does(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=Q.Q4_1)
    blocks = dict(read_gguf_lazily(path).weights())
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, quant.FileBlocks) and q.shape == (64, 64)
    assert isinstance(blocks["model.norm.weight"], torch.Tensor)
    first, rows = next(q.rows())
    assert first == 0 and rows.codes.shape == (64, 2, 4, 4) and rows.scale.dtype == torch.float16
    values = q.values()
    assert values.dtype == torch.float32 and values.shape == (64, 64)


# a Q4_K_M download's mix: Q4_K, with attn_v and ffn_down Q6_K in some layers, and a Q6_K head
Q4_K_M_TYPES = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K,
                **{f"blk.{i}.{part}.weight": Q.Q4_K for i in range(mixed.LAYERS) for part in mixed.SHAPES},
                "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K}


def test_auto_repacks_q4_k_and_keeps_q6_k_in_int8g(tmp_path, caplog):
    """Layer 0's q|k|v goes int8g with its Q6_K v (one product, one format) and its Q6_K down_proj int8g; its o_proj
    and gate|up, and all of layer 1, int4 with the file's codes; the Q6_K head int8g. One log line says so."""
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, Q4_K_M_TYPES)
    with caplog.at_level(logging.INFO, logger="engine.model.quant"):
        model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    formats = {name: weight_ops.weight_format(m.weight, m.weight_scale) for name, m in model.named_modules()
               if isinstance(m, Linear)}
    assert formats == {
        "layers.0.self_attn.qkv_proj": "int8g", "layers.0.self_attn.o_proj": "int4",
        "layers.0.mlp.gate_up_proj": "int4", "layers.0.mlp.down_proj": "int8g",
        **{f"layers.1.{part}": "int4" for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                   "mlp.down_proj")}}
    assert model.weight_dtype == "int8g+int4"
    assert weight_ops.weight_format(model.lm_head.weight, model.lm_head.weight_scale) == "int8g"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight dtype auto")]
    assert lines == ["weight dtype auto: projections int4 (the file's codes and scales repacked; Q4_K's sub-block "
                     "scales to fp16): 10 Q4_K; int8g (the file's codes as int8, fp32 scales per 16 or 32, exactly): "
                     "2 Q4_K, 2 Q6_K; LM head Q6_K -> int8g"]


def test_explicit_int4_repacks_q4_k_and_quantises_q6_k(tmp_path):
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, Q4_K_M_TYPES)
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="int4")
    assert model.weight_dtype == "int4" and weight_ops.is_int4(model.lm_head.weight)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    repacked, table, _ = as_int4(reader["blk.0.attn_output.weight"].data, Q.Q4_K)
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, repacked)
    down = model.layers[0].mlp.down_proj  # Q6_K: quantised from its values, as a float checkpoint's are
    want = torch.from_numpy(reference(reader["blk.0.ffn_down.weight"].data, Q.Q6_K))
    packed, table = (torch.zeros_like(t) for t in (down.weight, down.weight_scale))
    quant.store_int4(packed, table, 0, want)
    assert torch.equal(down.weight, packed) and torch.equal(down.weight_scale, table)


def test_a_scale_past_fp16s_range_is_refused_naming_the_tensor(tmp_path, monkeypatch):
    """Q4_0's z = -8 d overflows fp16 for |d| > 8188, past what the int4 format holds (no real model has such
    scales): int4 refuses the file with an error naming the tensor; bfloat16 loads it."""
    plain = mixed.quantised_bytes

    def huge(rng, shape, qtype):
        data = plain(rng, shape, qtype)
        if qtype == Q.Q4_0:
            data[0, 0:2] = np.array([10000.0], dtype=F16).view(np.uint8)
        return data

    monkeypatch.setattr(mixed, "quantised_bytes", huge)
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, {**Q4_K_M_TYPES, "blk.1.attn_output.weight": Q.Q4_0})
    with pytest.raises(ModelLoadError, match=r"GGUF tensor blk\.1\.attn_output\.weight \(Q4_0\) has 1 blocks whose "
                                             r"scale or offset exceeds fp16's range.*--weight-dtype bfloat16\)$"):
        load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="bfloat16")
    assert model.layers[1].self_attn.o_proj.weight[0, 0].abs() > 8000
