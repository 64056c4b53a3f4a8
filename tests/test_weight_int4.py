"""int4 weights with a scale and offset per group of 32 (engine/model/quant.py, engine/kernels/int4_linear.cpp): the
format and its layout, the W4A8 kernel against the float64 reference of its arithmetic and against the dequantised
product, the model with int4 weights against its bf16 self, its bytes against int8's and bf16's, and `auto`'s
choice on tiny GGUF files."""
from __future__ import annotations

import logging

import gguf
import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.backends import TorchBackend
from engine.backends import weight_ops
from engine.config import ConfigError, EngineConfig
from engine.kernels import cpu_ext
from engine.model import quant
from engine.model.gguf_loader import read_gguf
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import LlamaModel, build_model
from engine.model.loader import load_model, resolve_model
from tests.kernel_helpers import kernel_backend, require_kernels
from tests.test_gguf_loader import write_gguf
from tests.test_weight_int8 import IDS, decode_logits, forward_logits
from tests.tiny_models import tiny_llama_config, write_tiny_model

Q = gguf.GGMLQuantizationType
G = weight_ops.INT4_GROUP


def require_w4a8() -> None:
    require_kernels()
    if not cpu_ext.w4a8_vnni():
        pytest.skip("the W4A8 kernel was built without AVX-512 VNNI (its scalar loop is slower than dequantising)")


def int4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed, scales), as the model stores it."""
    codes_shape, scales_shape = weight_ops.int4_shapes(*w.shape)
    packed, scales = torch.zeros(codes_shape, dtype=torch.uint8), torch.zeros(scales_shape, dtype=torch.float16)
    quant.store_int4(packed, scales, 0, w)
    return packed, scales


def dequantised(packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    return weight_ops.int4_rows(packed, scales, torch.arange(weight_ops.int4_channels(scales)), k, torch.float64)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """activation_quant.h's definition in torch: x [M, K] -> (codes [M, G * 32] fp64, zero past K; a [M, G])."""
    m, k = x.shape
    groups = -(-k // G)
    xf = torch.zeros(m, groups * G)
    xf[:, :k] = x.float()
    xg = xf.view(m, groups, G)
    a = xg.abs().amax(dim=2) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    codes = torch.round(xg / a.unsqueeze(2)).clamp(-127, 127)
    return codes.view(m, -1).double(), a.double()


def reference_w4a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in float64: sum_g (a_g s_g ((q - 7.5) . x_q) + (z_g + 7.5 s_g) sum_g x) + bias,
    the weights split about their group's middle, whose term takes the activations' own sums."""
    m, k = x.shape
    n = weight_ops.int4_channels(scales)
    xq, a = quantize_activations(x)
    codes = weight_ops.unpack_int4(packed, torch.arange(n)).double()  # [N, G * 32]
    groups = a.shape[1]
    dots = torch.einsum("mgi,ngi->mng", xq.view(m, groups, G), codes.view(n, groups, G) - 7.5)
    xf = torch.zeros(m, groups * G, dtype=torch.float64)
    xf[:, :k] = x.double()
    totals = xf.view(m, groups, G).sum(-1)  # [M, G]
    s, z = (part.double() for part in weight_ops.int4_scales_of(scales, torch.arange(n)))  # [N, G]
    out = (s * dots * a.unsqueeze(1) + (z + 7.5 * s) * totals.unsqueeze(1)).sum(-1)
    return out if bias is None else out + bias.double()


# ---- the format ----------------------------------------------------------------------------------------------


def group_values(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n, groups = scale.shape
    return (codes.view(n, groups, G).float() * scale.float().unsqueeze(2) + offset.float().unsqueeze(2))


def test_quantize_int4_offsets_at_one_end_and_beats_min_max():
    torch.manual_seed(0)
    w = torch.randn(9, 70) * torch.linspace(0.01, 3, 9).unsqueeze(1)
    w[4, :32] = 0.25  # a constant group
    codes, scale, offset = quant.quantize_int4(w)
    assert codes.shape == (9, 96) and scale.shape == offset.shape == (9, 3)
    assert codes.dtype == torch.uint8 and scale.dtype == offset.dtype == torch.float16
    assert codes.max() <= 15 and (codes[:, 70:] == 0).all()
    assert scale[4, 0] == 0 and offset[4, 0] == 0.25 and (codes[4, :32] == 0).all()
    full = w[:, :64].reshape(9, 2, G)
    low, high = full.amin(-1).to(torch.float16), full.amax(-1).to(torch.float16)
    at_low = (offset[:, :2] == low) & (scale[:, :2] >= 0)
    assert (at_low | ((offset[:, :2] == high) & (scale[:, :2] <= 0))).all()
    err = (group_values(codes, scale, offset)[:, :2] - full).square().sum(-1)
    # against the plain min-max rule (from the minimum, span 15)
    s15 = ((full.amax(-1) - low.float()) / 15).to(torch.float16).float()
    q15 = torch.round((full - low.float().unsqueeze(2)) / torch.where(s15 > 0, s15, 1).unsqueeze(2)).clamp(0, 15)
    err15 = (q15 * s15.unsqueeze(2) + low.float().unsqueeze(2) - full).square().sum(-1)
    assert (err <= err15).all()
    assert (err < err15).any()  # the other candidates do win somewhere


@pytest.mark.parametrize("low,high", [(0, 15), (0, 12), (3, 15)])
@pytest.mark.parametrize("sign", [1, -1])
def test_quantize_int4_recovers_values_on_a_4_bit_grid(low, high, sign):
    """Values z + s q with fp16 s, z and codes reaching only [low, high] of 0..15 (GGUF Q4_0 blocks reach one end
    only; its d may be negative) come back exactly where the span high - low is one INT4_SPANS tries."""
    gen = torch.Generator().manual_seed(low * 16 + high)
    s = (sign * (torch.rand(8, 1, generator=gen) * 0.1 + 0.01)).to(torch.float16).float()
    z = (torch.randn(8, 1, generator=gen)).to(torch.float16).float()
    q = torch.randint(low, high + 1, (8, G), generator=gen).float()
    q[:, 0], q[:, 1] = low, high
    w = z + s * (q - low)
    codes, scale, offset = quant.quantize_int4(w)
    assert torch.equal(group_values(codes, scale, offset).view(8, G), w)


def test_pack_int4_layout():
    torch.manual_seed(1)
    w = torch.randn(37, 70)
    packed, scales = int4_weight(w)
    codes, scale, offset = quant.quantize_int4(w)
    assert packed.shape == (3, 3, 4, 16, 4) and scales.shape == (2, 3, 37)  # N off a block: [2, G, N]
    for n, g, t, j in [(0, 0, 0, 0), (17, 1, 3, 2), (36, 2, 1, 3), (15, 0, 2, 1)]:
        byte = int(packed[n // 16, g, t, n % 16, j])
        assert byte & 15 == codes[n, 32 * g + 4 * t + j] and byte >> 4 == codes[n, 32 * g + 16 + 4 * t + j]
    assert (packed[2, :, :, 5:] == 0).all()  # channels past 37
    assert torch.equal(scales[0].T, scale) and torch.equal(scales[1].T, offset)
    assert torch.equal(weight_ops.unpack_int4(packed, torch.arange(37)), codes)


def test_blocked_scales_hold_each_channels_scale_and_offset():
    torch.manual_seed(1)
    w = torch.randn(48, 70)
    packed, scales = int4_weight(w)
    _, scale, offset = quant.quantize_int4(w)
    assert scales.shape == (3, 3, 2, 16) and weight_ops.int4_channels(scales) == 48  # N a multiple of 16
    assert torch.equal(scales[1, 2, 0, 5], scale[21, 2]) and torch.equal(scales[2, 0, 1, 15], offset[47, 0])
    assert all(torch.equal(a, b) for a, b in zip(weight_ops.int4_scales_of(scales, torch.arange(48)), (scale, offset)))
    assert all(torch.equal(a, b[10:30]) for a, b in zip(weight_ops.int4_scales_of(scales, slice(10, 30)),
                                                         (scale, offset)))


@pytest.mark.parametrize("n", [50, 64])  # scales [2, G, N], and blocked
def test_store_int4_row_chunks_equal_one_store(n):
    """The loader writes a fused weight in pieces at row offsets that need not fall on 16-channel blocks."""
    torch.manual_seed(2)
    w = torch.randn(n, 64)
    whole = int4_weight(w)
    packed, scales = (torch.zeros_like(t) for t in whole)
    for first, last in ((0, 7), (7, 31), (31, n)):
        quant.store_int4(packed, scales, first, w[first:last])
    assert torch.equal(packed, whole[0]) and torch.equal(scales, whole[1])


# ---- the kernels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536), (16, 32)])
def test_dequantize_kernel_is_torch_bit_for_bit(n, k):
    require_kernels()
    torch.manual_seed(n + k)
    packed, scales = int4_weight(torch.randn(n, k) * 0.05)
    ref = weight_ops.int4_rows(packed, scales, torch.arange(n), k, torch.bfloat16)
    assert torch.equal(cpu_ext.dequantize_int4(packed, scales, k, 0, n), ref)
    assert torch.equal(cpu_ext.dequantize_int4(packed, scales, k, n // 3, n), ref[n // 3:])
    exact = weight_ops.int4_rows(packed, scales, torch.arange(n), k, torch.float32)  # what linear32 multiplies by
    assert torch.equal(cpu_ext.dequantize_int4(packed, scales, k, n // 3, n, fp32_out=True), exact[n // 3:])


def test_every_kernel_reads_blocked_scales_as_the_same_values_laid_out_2_g_n():
    require_kernels()
    torch.manual_seed(4)
    n, k = 96, 300
    packed, blocked = int4_weight(torch.randn(n, k) * 0.05)
    flat = torch.stack(weight_ops.int4_scales_of(blocked, torch.arange(n))).transpose(1, 2).contiguous()  # [2, G, N]
    bias = torch.randn(n).to(torch.bfloat16)
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, k).to(torch.bfloat16)
        for kernel in (cpu_ext.linear_int4, cpu_ext.linear_int4_gemm, cpu_ext.linear_int4_bf16, cpu_ext.linear_w4a8):
            got, want = kernel(x, packed, blocked, bias), kernel(x, packed, flat, bias)
            assert torch.equal(got, want), (kernel.__name__, rows)
    assert torch.equal(cpu_ext.dequantize_int4(packed, blocked, k, 5, 90),
                       cpu_ext.dequantize_int4(packed, flat, k, 5, 90))


def test_dequantize_kernel_keeps_torchs_bits_for_nan_and_huge_scales():
    """The vector path's rounding (to nearest even) against torch's, lane by lane; a NaN stays a NaN (the kernel
    writes one quiet NaN, torch keeps the sign the arithmetic gave)."""
    require_kernels()
    torch.manual_seed(5)
    n, k = 48, 96
    packed, scales = int4_weight(torch.randn(n, k) * 0.05)
    assert scales.shape == (3, 3, 2, 16)  # blocked: [N / 16, G, 2, 16]
    # s of group 0, channel 1; z of group 1, channel 2; s of group 2, channel 17
    scales[0, 0, 0, 1], scales[0, 1, 1, 2], scales[1, 2, 0, 1] = float("nan"), float("inf"), 65504.0
    scales[2, 0, 1, 1] = -3.0e-8  # a subnormal minimum (z of group 0, channel 33)
    ref = weight_ops.int4_rows(packed, scales, torch.arange(n), k, torch.bfloat16)
    out = cpu_ext.dequantize_int4(packed, scales, k, 0, n)
    nan = ref.isnan()
    assert nan.any() and torch.equal(out.isnan(), nan) and ref.isinf().any()
    assert torch.equal(out[~nan].view(torch.int16), ref[~nan].view(torch.int16))


def product_case(rows: int, n: int, k: int, with_bias: bool):
    """(x, packed, scales, bias) of one seeded product: x with an outlier group (its own scale, the others
    unaffected), weights with a mean off zero (the offsets matter), a bf16 bias or None."""
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    x[0, : min(k, 8)] *= 50
    packed, scales = int4_weight(torch.randn(n, k) * 0.05 + 0.01)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    return x, packed, scales, bias


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 64])  # passes of up to 8 rows: 11 = 8 + 3
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4a8_matches_the_reference_arithmetic(rows, n, k, with_bias):
    """Odd channel counts (masked scale loads, blocks of 1-15 channels), K not a multiple of 32 (padded codes),
    K below one group: within one bf16 rounding of the float64 reference of the same quantised arithmetic, and
    equal to it rounded but where the fp32 sum over groups sits within an fp32 error of a rounding boundary."""
    require_w4a8()
    x, packed, scales, bias = product_case(rows, n, k, with_bias)
    got = cpu_ext.linear_w4a8(x, packed, scales, bias)
    ref = reference_w4a8(x, packed, scales, bias)
    assert_rounded_once(got, ref, x, dequantised(packed, scales, k), (rows, n), sum_error=2 ** -20)


def assert_rounded_once(got, ref, x, weights, shape, sum_error: float) -> None:
    """got (bf16 `shape`) within one bf16 rounding of the float64 `ref`, plus `sum_error` of sum |x w| for the
    kernel's own sums, and equal to ref rounded but near rounding boundaries."""
    assert got.dtype == torch.bfloat16 and got.shape == shape
    scale = ref.abs() + (x.double().abs() @ weights.abs().T) * sum_error
    assert ((got.double() - ref).abs() <= scale * 2 ** -8).all()
    assert (got == ref.to(torch.bfloat16)).double().mean() >= 0.98


def test_w4a8_is_close_to_the_dequantised_product():
    """Group-of-32 activation codes lose little against the product of x and the dequantised weights in fp32."""
    require_w4a8()
    torch.manual_seed(3)
    x = torch.randn(4, 576).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(300, 576) * 0.05)
    got = cpu_ext.linear_w4a8(x, packed, scales).double()
    ref = x.double() @ dequantised(packed, scales, 576).T
    assert ((got - ref).norm() / ref.norm()) < 0.01


def test_w4a8_each_row_depends_on_that_row_only():
    require_w4a8()
    torch.manual_seed(4)
    x = torch.randn(13, 300).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(70, 300))
    batched = cpu_ext.linear_w4a8(x, packed, scales)
    for r in (0, 7, 8, 12):
        assert torch.equal(cpu_ext.linear_w4a8(x[r:r + 1], packed, scales), batched[r:r + 1])


def require_int4_kernel() -> None:
    require_kernels()
    if not cpu_ext.int4_vectorized():
        pytest.skip("the weight-only int4 kernel was built without AVX2, FMA and F16C")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])  # passes of up to 2 rows: 3 = 2 + 1
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_only_int4_is_the_exact_product_rounded_once(rows, n, k, with_bias):
    """Odd channel counts (blocks of 1-15 channels), K not a multiple of 32 (padded codes), K below one group, an
    outlier group of activations: within one bf16 rounding of the float64 product of x and the dequantised weights
    (and the fp32 sums' error), and equal to it rounded but near rounding boundaries. One wrong code would move
    a result by about sum |x w| / K, far past either bound."""
    require_int4_kernel()
    x, packed, scales, bias = product_case(rows, n, k, with_bias)
    got = cpu_ext.linear_int4(x, packed, scales, bias)
    weights = dequantised(packed, scales, k)
    ref = x.double() @ weights.T + (0 if bias is None else bias.double())
    assert_rounded_once(got, ref, x, weights, (rows, n), sum_error=2 ** -7)  # fp32 sums: ~sqrt(K) 2^-24 of sum |x w|


def test_weight_only_int4_rows_are_independent_and_fp32_rows_are_taken():
    require_int4_kernel()
    torch.manual_seed(5)
    x = torch.randn(13, 300).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(70, 300))
    batched = cpu_ext.linear_int4(x, packed, scales)
    for r in (0, 7, 8, 12):
        assert torch.equal(cpu_ext.linear_int4(x[r:r + 1], packed, scales), batched[r:r + 1])
    assert torch.equal(cpu_ext.linear_int4(x.float(), packed, scales), batched)  # the same fp32 values
    with pytest.raises(RuntimeError, match="groups"):
        cpu_ext.linear_int4(x, packed, scales[:, :1].contiguous())


def test_w4a8_refuses_a_layout_of_other_shapes():
    require_kernels()
    x = torch.randn(2, 64).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="groups"):
        cpu_ext.linear_w4a8(x, packed, scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="packed"):
        cpu_ext.linear_w4a8(x, packed[:, :1].contiguous(), scales)
    with pytest.raises(RuntimeError, match="fp16"):
        cpu_ext.linear_w4a8(x, packed, scales.float())


# ---- the model -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A tiny Llama with its own LM head and intermediate size 96 (gate|up 192 rows: not all in whole groups)."""
    config = tiny_llama_config(tie_word_embeddings=False, num_key_value_heads=2, intermediate_size=96)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-untied-int4"), config, seed=5)


def load(folder, weight_dtype: str):
    return build_model(read_hf_config(folder), iter_hf_weights(folder), torch.bfloat16, weight_dtype=weight_dtype)


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, with the quantised weights' scales."""
    tensors = list(model.parameters()) + list(model.buffers()) + list(quant.weight_scales(model).values())
    return sum(t.numel() * t.element_size() for t in tensors)


def test_int4_model_holds_only_the_int4_layout(tiny_model_dir, untied_dir):
    for folder in (tiny_model_dir, untied_dir):
        models = {d: load(folder, d) for d in ("bfloat16", "int8", "int4")}
        int4 = models["int4"]
        assert int4.weight_dtype == "int4" and int4.dtype == torch.bfloat16
        for module in quant.quantized_modules(int4):
            n, k = (module.out_features, module.in_features) if hasattr(module, "out_features") else (
                module.num_embeddings, module.embedding_dim)
            codes, scales = weight_ops.int4_shapes(n, k)
            assert module.weight.dtype == torch.uint8 and module.weight.shape == codes
            assert module.weight_scale.dtype == torch.float16 and module.weight_scale.shape == scales
        sizes = {d: model_bytes(m) for d, m in models.items()}
        assert sizes["int4"] < sizes["int8"] < sizes["bfloat16"]
        # K a multiple of 32 and N of 16 here: exactly 4 bits of code and 2 fp16 per 32 weights, 0.625 bytes each
        for module in quant.quantized_modules(int4):
            weights = weight_ops.int4_channels(module.weight_scale) * module.weight_scale.shape[1] * G
            assert module.weight.numel() + 2 * module.weight_scale.numel() == weights * 5 // 8
        # no bf16 copy beside the codes: the bf16 tensors left are the norms (and an untied embedding table)
        plain = {n for n, p in int4.named_parameters() if p.is_floating_point()}
        assert all(n.endswith("norm.weight") or n == "embed_tokens.weight" for n in plain), plain


def test_int4_codes_come_from_the_checkpoint_rows(tiny_model_dir):
    """The fused q|k|v weight's k rows dequantise to the checkpoint's k_proj quantised alone."""
    int4 = load(tiny_model_dir, "int4")
    cfg = int4.cfg
    k_proj = dict(iter_hf_weights(tiny_model_dir))["model.layers.1.self_attn.k_proj.weight"]
    qkv = int4.layers[1].self_attn.qkv_proj
    rows = torch.arange(cfg.q_size, cfg.q_size + cfg.kv_size)
    got = weight_ops.int4_rows(qkv.weight, qkv.weight_scale, rows, cfg.hidden_size, torch.float32)
    packed, scales = int4_weight(k_proj)
    assert torch.equal(got, weight_ops.int4_rows(packed, scales, torch.arange(cfg.kv_size), cfg.hidden_size,
                                            torch.float32))


def test_int4_embedding_rows_are_the_lm_head_rows(tiny_model_dir):
    int4 = load(tiny_model_dir, "int4")
    ids = torch.tensor([0, 5, 17, 511])
    table = int4.embed_tokens
    assert torch.equal(int4.embed(ids), weight_ops.int4_rows(table.weight, table.weight_scale, ids, 64, torch.bfloat16))


# (max |diff|, mean |diff|) of the kernel paths' logits against the same int4 weights on plain torch ops (bf16
# logits of std ~1; the bf16 kernels' own rounding order already differs from torch's by up to 0.0625, mean
# 0.007). Measured on the two tiny models: W4A8 (activations quantised to int8, which torch's path does not do)
# 0.174 / 0.021; dequantised to bf16 for F.linear 0.059 / 0.0078. The weight-only kernel keeps the weights exact in
# fp32 where torch's path rounds them to bf16: 0.086 / 0.0115 on Zen 2 (Python layers; the dequantised path there
# 0.043 / 0.0040, so the AVX-512 kernels' own rounding adds about 0.016 / 0.004).
INT4_PATHS = {"w4a8": (dict(max_w4a8_rows=64), 0.25, 0.03),
              "weight-only": (dict(max_w4a8_rows=0, max_int4_rows=64), 0.15, 0.02),
              "dequantised": (dict(max_w4a8_rows=0, max_int4_rows=0), 0.1, 0.015)}


@pytest.mark.parametrize("path", INT4_PATHS)
def test_int4_logits_match_the_torch_int4_reference(tiny_model_dir, untied_dir, path):
    limits, max_diff, mean_diff = INT4_PATHS[path]
    require_kernels(vectors=True)
    for folder in (tiny_model_dir, untied_dir):
        model = load(folder, "int4")
        model.set_backend(TorchBackend())
        ref = forward_logits(model, IDS)
        for stack in (True, False):
            model.set_backend(kernel_backend(decode_stack=stack, **limits))
            assert (model.prepared.stack is not None) == stack
            for got in (forward_logits(model, IDS), decode_logits(model, IDS)):
                diff = (got - ref).abs()
                assert diff.max() <= max_diff and diff.mean() <= mean_diff, (diff.max(), diff.mean())


@pytest.mark.parametrize("path", INT4_PATHS)
def test_int4_decode_stack_is_bit_identical_to_the_python_layers(tiny_model_dir, path):
    require_kernels(vectors=True)
    model = load(tiny_model_dir, "int4")
    got = {}
    for stack in (True, False):
        model.set_backend(kernel_backend(decode_stack=stack, **INT4_PATHS[path][0]))
        got[stack] = decode_logits(model, IDS[:12])
    assert torch.equal(got[True], got[False])


# The error model: groups of 32 Gaussian weights span about 4.1 std, so a code step is 0.27 std and each weight moves
# by 0.08 std (uniform in half a step); int8's per-row steps over 64 values are 14x finer, and the KL grows with
# the square (about 200x). On the random tiny models (flat logits of std 1 over 512 tokens, so near-ties flip)
# measured: int4 KL 0.049 / 0.054 and top-1 0.575 / 0.525 on the tied / untied model over 40 positions (int8
# 0.0006 / 0.0006, 1.0 / 0.925; chance top-1 is 1/512). SmolLM2's figures: docs/performance.md
# (python -m bench.weight_quant).
INT4_TOP1_THRESHOLD = 0.4
INT4_KL_LIMIT = 0.1


def test_int4_agrees_with_bf16_teacher_forced(tiny_model_dir, untied_dir):
    require_kernels(vectors=True)
    for folder in (tiny_model_dir, untied_dir):
        bf16, int4 = load(folder, "bfloat16"), load(folder, "int4")
        bf16.set_backend(kernel_backend())
        int4.set_backend(kernel_backend())
        ref, got = decode_logits(bf16, IDS), decode_logits(int4, IDS)
        agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()
        assert agree >= INT4_TOP1_THRESHOLD, agree
        assert kl < INT4_KL_LIMIT, kl
        int8 = load(folder, "int8")
        int8.set_backend(kernel_backend())
        kl8 = F.kl_div(decode_logits(int8, IDS).log_softmax(-1), ref.log_softmax(-1), log_target=True,
                       reduction="batchmean").item()
        assert kl8 < kl / 10  # the error model ranks them


def test_llm_generates_with_int4_weights(tiny_model_dir):
    """LLM(weight_dtype="int4") end to end: each greedy first token is the argmax of that model's own logits."""
    require_kernels(vectors=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [IDS[:7], IDS[10:23], IDS[5:9]]
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", weight_dtype="int4", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.weight_dtype == "int4"
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert [o.token_ids[0] for o in outs] == [int(forward_logits(model, p)[-1].argmax()) for p in prompts]


# ---- the option and `auto` -------------------------------------------------------------------------------------


def test_weight_dtype_names_the_allowed_values():
    assert EngineConfig(weight_dtype="int4").weight_dtype == "int4"
    with pytest.raises(ConfigError, match="weight_dtype must be one of auto, bfloat16, int8, int4, got 'int3'"):
        EngineConfig(weight_dtype="int3")
    with pytest.raises(ValueError, match="auto, bfloat16, int8, int4"):
        quant.resolve_weight_dtype("q4")


@pytest.mark.parametrize("q,k,v,expected", [
    ("Q4_0", "Q4_0", "Q4_0", "int4"), ("Q4_0", "Q4_1", "Q4_1", "int4"), ("Q4_0", "Q4_1", "Q4_K", "int4"),
    ("Q4_K", "Q4_K", "Q6_K", "int8g"), ("Q8_0", "Q8_0", "Q8_0", "int8g"), ("Q3_K", "Q3_K", "Q3_K", "int8g"),
    ("Q4_0", "Q4_0", "F16", "bfloat16"), ("F16", "F16", "F16", "bfloat16")])
def test_auto_chooses_each_projection_by_every_tensor_it_fuses(q, k, v, expected):
    """q|k|v is one product: int4 only where all three are Q4_0 / Q4_1 / Q4_K blocks, int8g where all three are
    quantised blocks; o_proj (Q4_0) by itself; the LM head (here the tied embedding) by its own type; the
    embedding and norms never vote for the layers."""
    names = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
             "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": "Q4_0",
             "model.embed_tokens.weight": "Q8_0", "model.norm.weight": "F32"}
    choice, why = quant.auto_weight_dtype(names, parameter_name=LlamaModel.parameter_name)
    assert dict(choice.modules) == {"layers.0.self_attn.qkv_proj.weight": expected,
                                    "layers.0.self_attn.o_proj.weight": "int4"}
    assert choice.head == "int8g" and why.endswith("LM head Q8_0 -> int8g")
    assert ("bfloat16 (float tensors, or fused with one): " in why) == (expected == "bfloat16")
    untied = {**names, "lm_head.weight": "Q4_0"}
    assert quant.auto_weight_dtype(untied, tied=False)[0].head == "int4"


def test_auto_on_a_folder_and_the_choice_names_only_projections(tiny_model_dir):
    choice, why = quant.auto_weight_dtype({})
    assert choice == quant.WeightChoice("bfloat16", "bfloat16") and "no GGUF-quantised" in why
    with pytest.raises(ValueError, match=r"not the model's projections.*layers\.0\.self_attn\.qkv_proj\.weight"):
        build_model(read_hf_config(tiny_model_dir), iter_hf_weights(tiny_model_dir), torch.bfloat16,
                    weight_dtype=quant.WeightChoice("bfloat16", "bfloat16", {"layers.0.q_proj.weight": "int4"}))


def auto_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight dtype auto")]


@pytest.mark.parametrize("qtype,expected", [(Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.Q8_0, "int8g"),
                                            (Q.Q5_0, "int8g"), (Q.F16, "bfloat16")])
def test_auto_on_tiny_gguf_files(tmp_path, caplog, qtype, expected):
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=qtype)
    with caplog.at_level(logging.INFO, logger="engine.model.quant"):
        model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    assert model.weight_dtype == expected
    head = model.head_module().weight.dtype
    assert head == {"int4": torch.uint8, "int8g": torch.int8, "bfloat16": torch.bfloat16}[expected]
    lines = auto_lines(caplog)
    assert len(lines) == 1 and f"14 {qtype.name}" in lines[0]  # 7 projections in each of 2 layers
    assert f"projections {expected} (" in lines[0]


def test_auto_keeps_a_hugging_face_folder_and_float32_unquantised(tmp_path, caplog, tiny_model_dir):
    assert load_model(resolve_model(tiny_model_dir), torch.bfloat16, weight_dtype="auto").weight_dtype == "bfloat16"
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="engine.model.quant"):
        model = load_model(resolve_model(path), torch.float32, weight_dtype="auto")
    assert model.weight_dtype == "float32" and "float32 weights" in auto_lines(caplog)[0]


def test_auto_on_q4_layers_with_a_q8_head_keeps_the_heads_values(tmp_path, monkeypatch):
    """The default SmolLM2 file's shape: Q4_1 projections, a Q8_0 tied embedding -> int4 layers, an int8g head
    (the embedding's rows dequantised from it exactly)."""
    import tests.test_gguf_loader as writer

    plain = writer.add_tensor
    monkeypatch.setattr(writer, "add_tensor", lambda w, name, value, qtype: plain(
        w, name, value, Q.Q8_0 if name == "token_embd.weight" else qtype))
    path = tmp_path / "m.gguf"
    write_gguf(path, qtype=Q.Q4_1)
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    assert model.weight_dtype == "int4" and model.embed_tokens.weight.dtype == torch.int8
    ids = torch.tensor([3, 17])
    want = read_gguf(path).weights["model.embed_tokens.weight"][ids]
    assert torch.equal(model.embed(ids), want.to(torch.bfloat16))


def test_int4_layers_with_an_int8_head(tiny_model_dir):
    """Formats mix per module: the kernel backend packs the int8 head alone for W8A8, and the logits match the
    torch path on the same weights within the W4A8 bound."""
    require_kernels(vectors=True)
    model = build_model(read_hf_config(tiny_model_dir), iter_hf_weights(tiny_model_dir), torch.bfloat16,
                        weight_dtype=quant.WeightChoice("int4", "int8"))
    assert model.weight_dtype == "int4" and model.embed_tokens.weight.dtype == torch.int8
    model.set_backend(TorchBackend())
    ref = forward_logits(model, IDS)
    backend = kernel_backend()
    model.set_backend(backend)
    assert all(w.packed is None for w in model.prepared.linears.values())  # the int4 layers: no copy
    assert (model.prepared.head.packed is not None) == backend.dispatch.int8.uses("w8a8")  # the head's W8A8 copy
    diff = (decode_logits(model, IDS) - ref).abs()
    _, max_diff, mean_diff = INT4_PATHS["w4a8"]  # the loosest of the int4 paths
    assert diff.max() <= max_diff and diff.mean() <= mean_diff
