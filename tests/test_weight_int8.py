"""int8 weights with per-output-channel scales (engine/model/quant.py, engine/kernels/int8_linear.cpp): the format,
the kernel against a torch reference, and the model with int8 weights against its bf16 self and the torch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.backends import weight_ops
from engine.backends.attention import AttentionMetadata
from engine.backends import TorchBackend
from engine.config import ConfigError, EngineConfig
from engine.kernels import cpu_ext
from engine.kv.cache import KVCache
from engine.model import quant
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.layers import Linear
from engine.model.llama import build_model
from tests.kernel_helpers import kernel_backend, require_kernels
from tests.tiny_models import tiny_llama_config, write_tiny_model

BLOCK = 4


def reference_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's definition in fp32: (x codes^T) * scale + bias."""
    out = (x.float() @ codes.float().T) * scale
    return out if bias is None else out + bias.float()


def test_quantize_rows_is_symmetric_absmax_per_row():
    torch.manual_seed(0)
    w = torch.randn(37, 53) * torch.linspace(0.01, 3, 37).unsqueeze(1)  # rows of very different ranges
    w[5] = 0  # an all-zero row
    codes, scale = quant.quantize_rows(w)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert codes.abs().max() <= 127 and (codes.abs().amax(dim=1)[torch.arange(37) != 5] == 127).all()
    assert scale[5] == 1 and (codes[5] == 0).all()
    torch.testing.assert_close(scale[torch.arange(37) != 5], w.abs().amax(dim=1)[torch.arange(37) != 5] / 127)
    err = (codes.float() * scale.unsqueeze(1) - w).abs()
    assert (err <= scale.unsqueeze(1) / 2 + 1e-6).all()  # round to nearest: at most half a step


def test_dequantize_rounds_once_to_the_dtype():
    codes = torch.randint(-127, 128, (8, 40), dtype=torch.int8)
    scale = torch.rand(8) * 0.1 + 1e-3
    got = weight_ops.dequantize(codes, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (codes.float() * scale.unsqueeze(1)).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 64])  # passes of up to 8 rows: 11 = 8 + 3
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_fp32_reference(rows, n, k, with_bias):
    """Odd channel counts and reduction lengths (masked tails of 1-15 lanes, K below one vector), within one
    bf16 rounding of the fp32 reference."""
    require_kernels()
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(n, k) * 0.05)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    got = cpu_ext.linear_int8(x, codes, scale, bias)
    ref = reference_int8(x, codes, scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


def test_each_row_depends_on_that_row_only():
    """A row's result is the same alone as inside a batch of 8 or 13 (the same reduction order)."""
    require_kernels()
    torch.manual_seed(1)
    x = torch.randn(13, 300).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(70, 300))
    batched = cpu_ext.linear_int8(x, codes, scale)
    for r in (0, 7, 8, 12):
        assert torch.equal(cpu_ext.linear_int8(x[r:r + 1], codes, scale), batched[r:r + 1])


def test_kernel_refuses_other_dtypes():
    require_kernels()
    x = torch.randn(2, 32).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="int8"):
        cpu_ext.linear_int8(x, codes.float(), scale)
    with pytest.raises(RuntimeError, match="scale"):
        cpu_ext.linear_int8(x, codes, scale.to(torch.bfloat16))


# ---- the W8A8 kernel: int8 activations in groups of 32, int32 sums on VNNI ----------------------------------


def require_w8a8() -> None:
    require_kernels(vectors=True)
    if not cpu_ext.w8a8_vnni():
        pytest.skip("the CPU kernels were built without AVX-512 VNNI")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation format: x [M, K] -> codes [M, G, 32] (zero-padded past K) and scales [M, G],
    a = max |group| / 127 (1 for a group of zeros), q = round(x / a) to nearest even."""
    g = weight_ops.W8A8_GROUP
    m, k = x.shape
    padded = torch.zeros(m, -(-k // g) * g)
    padded[:, :k] = x.float()
    groups = padded.view(m, -1, g)
    amax = groups.abs().amax(-1)
    a = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(groups / a[..., None]).clamp(-127, 127), a


def group_sums(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Exact integer sums of each activation group against each weight row: [M, N, G] int64."""
    n, k = codes.shape
    padded = torch.zeros(n, q.shape[1] * q.shape[2], dtype=torch.int64)
    padded[:, :k] = codes
    return torch.einsum("mgk,ngk->mng", q.to(torch.int64), padded.view(n, q.shape[1], q.shape[2]))


def reference_w8a8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 product in float64 from the exact group sums: s[n] * sum_g a[m, g] * sum_g + bias."""
    q, a = quantize_activations(x)
    out = (group_sums(q, codes).double() * a.double()[:, None, :]).sum(-1) * scale.double()
    return out if bias is None else out + bias.double()


def test_pack_w8a8_layout():
    codes = torch.randint(-127, 128, (37, 70), dtype=torch.int8)
    packed = weight_ops.pack_w8a8(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 24, 16, 4)  # ceil(37/16), ceil(70/32) * 32 / 4
    for b, j, c, t in [(0, 0, 0, 0), (1, 5, 7, 3), (2, 17, 4, 1), (0, 12, 15, 2)]:
        assert int(packed[b, j, c, t]) == int(codes[16 * b + c, 4 * j + t]) + 128
    assert (packed[2, :, 5:] == 128).all() and (packed[:, 18:] == 128).all()  # channels past 37, k past 70


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 64])
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536), (64, 4)])
def test_w8a8_int32_sums_are_exact(rows, n, k):
    """Inputs whose every group scale is exactly 1 (each group holds a +-127) and weight scales 1, with sums
    small enough for bf16 to hold: the output is the integer sum itself, so a wrong product, correction for the
    unsigned weights, group boundary, padding or channel tail shows as an inequality."""
    require_w8a8()
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    g = weight_ops.W8A8_GROUP
    x = torch.randint(-1, 2, (rows, k), generator=gen).float()
    pos = [i * g + int(torch.randint(0, min(g, k - i * g), (1,), generator=gen)) for i in range(-(-k // g))]
    x[:, pos] = 127 * (torch.randint(0, 2, (rows, len(pos)), generator=gen) * 2 - 1).float()
    codes = torch.randint(-1, 2, (n, k), generator=gen).to(torch.int8)
    # only the first group's +-127 meets a weight, and only k < 100 hold weights: |sum| <= 127 + 99; the zero
    # weights past 100 still read as 128 each in the kernel, which its correction must cancel exactly
    codes[:, pos[1:]] = 0
    codes[:, 100:] = 0
    q, a = quantize_activations(x.to(torch.bfloat16))
    assert (a == 1).all()
    exact = group_sums(q, codes).sum(-1)
    assert exact.abs().max() < 256
    got = cpu_ext.linear_w8a8(x.to(torch.bfloat16), weight_ops.pack_w8a8(codes), torch.ones(n))
    assert torch.equal(got.float(), exact.float())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 64])
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_matches_the_reference_arithmetic(rows, n, k, with_bias):
    """Random activations and weights against the float64 reference of the same quantised arithmetic: within one
    bf16 rounding everywhere, and bit-equal to it rounded but where the kernel's fp32 sum over groups sits
    within an fp32 error of a bf16 rounding boundary."""
    require_w8a8()
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    x[0, : min(k, 8)] *= 50  # an outlier group: its own scale, the others unaffected
    codes, scale = quant.quantize_rows(torch.randn(n, k) * 0.05)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    got = cpu_ext.linear_w8a8(x, weight_ops.pack_w8a8(codes), scale, bias)
    ref = reference_w8a8(x, codes, scale, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert ((got.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-30).all()
    assert (got == ref.to(torch.bfloat16)).double().mean() >= 0.99


def test_w8a8_is_close_to_the_unquantised_product():
    """Group-of-32 activation codes lose little against the fp32-activation kernel on the same int8 weights."""
    require_w8a8()
    torch.manual_seed(2)
    x = torch.randn(4, 576).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(300, 576) * 0.05)
    got = cpu_ext.linear_w8a8(x, weight_ops.pack_w8a8(codes), scale).float()
    ref = reference_int8(x, codes, scale, None)
    assert ((got - ref).norm() / ref.norm()) < 0.01


def test_w8a8_each_row_depends_on_that_row_only():
    require_w8a8()
    torch.manual_seed(1)
    x = torch.randn(13, 300).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(70, 300))
    packed = weight_ops.pack_w8a8(codes)
    batched = cpu_ext.linear_w8a8(x, packed, scale)
    for r in (0, 7, 8, 12):
        assert torch.equal(cpu_ext.linear_w8a8(x[r:r + 1], packed, scale), batched[r:r + 1])


def test_w8a8_refuses_a_packing_of_other_shapes():
    require_kernels()
    x = torch.randn(2, 64).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="packed"):
        cpu_ext.linear_w8a8(x, weight_ops.pack_w8a8(codes[:, :32]), scale)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_ext.linear_w8a8(x, codes, scale)


# ---- the model -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    """A tiny Llama with its own LM head (not tied to the embeddings)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tiny_llama_config(tie_word_embeddings=False,
                                                                                       num_key_value_heads=2), seed=5)


def load(folder, weight_dtype: str):
    return build_model(read_hf_config(folder), iter_hf_weights(folder), torch.bfloat16, weight_dtype=weight_dtype)


def test_int8_model_keeps_int8_weights_and_no_bf16_copy(tiny_model_dir, untied_dir):
    for folder in (tiny_model_dir, untied_dir):
        bf16, int8 = load(folder, "bfloat16"), load(folder, "int8")
        for module in quant.quantized_modules(int8):
            assert module.weight.dtype == torch.int8 and module.weight_scale.shape == (module.weight.shape[0],)
        assert int8.weight_dtype == "int8" and bf16.weight_dtype == "bfloat16" and int8.dtype == torch.bfloat16
        assert not [m for m in bf16.modules() if getattr(m, "weight_scale", None) is not None]
        # everything but the norms (and an untied embedding) halves: the model's bytes
        nbytes = {name: sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
                  + sum(s.numel() * 4 for s in quant.weight_scales(m).values())
                  for name, m in (("bf16", bf16), ("int8", int8))}
        quantised = sum(mod.weight.numel() for mod in quant.quantized_modules(int8))
        assert nbytes["bf16"] - nbytes["int8"] == quantised - 4 * sum(
            mod.weight.shape[0] for mod in quant.quantized_modules(int8))
        for linear in (m for m in int8.modules() if isinstance(m, Linear)):
            assert linear.weight.dtype == torch.int8  # every projection of the layers


def test_int8_codes_come_from_the_checkpoint_rows(tiny_model_dir):
    """The fused q|k|v weight's k rows are quantised from the checkpoint's k_proj alone (per-row scales)."""
    int8 = load(tiny_model_dir, "int8")
    cfg = int8.cfg
    k_proj = dict(iter_hf_weights(tiny_model_dir))["model.layers.1.self_attn.k_proj.weight"]
    codes, scale = quant.quantize_rows(k_proj)
    qkv = int8.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.weight[cfg.q_size:cfg.q_size + cfg.kv_size], codes)
    assert torch.equal(qkv.weight_scale[cfg.q_size:cfg.q_size + cfg.kv_size], scale)


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced prefill of `ids` -> fp32 logits of every position."""
    kv = KVCache(model.cfg, 64, BLOCK, torch.bfloat16)
    table = list(range(-(-len(ids) // BLOCK)))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.build(BLOCK, [], [(table, 0, len(ids))],
                                                                                          True), kv.layers)
        return model.compute_logits(hidden)


def decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Token-by-token decode of `ids` (one row a step, the decode products) -> fp32 logits of every position."""
    kv = KVCache(model.cfg, 64, BLOCK, torch.bfloat16)
    table = list(range(-(-len(ids) // BLOCK)))
    out = []
    with torch.inference_mode():
        for pos, tok in enumerate(ids):
            meta = AttentionMetadata.build(BLOCK, [(table, pos + 1)], [], True)
            out.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([pos]), meta, kv.layers)))
    return torch.cat(out)


IDS = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))]


# (max_int8_rows, max_w8a8_rows, max |diff|, mean |diff|): bf16 logits of std ~1; the kernels' own rounding order
# (bf16 weights, decode) already differs from torch's by up to 0.0625, mean 0.007 here. Measured: fp32-activation
# kernel 0.074 / 0.010; W8A8 (activations quantised to int8, which torch's path does not do) 0.145 / 0.018.
PATHS = [(64, 0, 0.1, 0.015), (64, 64, 0.2, 0.025), (0, 0, 0.1, 0.015)]


@pytest.mark.parametrize("int8_rows,w8a8_rows,max_diff,mean_diff", PATHS, ids=["widen", "w8a8", "dequantised"])
def test_int8_logits_match_the_torch_int8_reference(tiny_model_dir, untied_dir, int8_rows, w8a8_rows, max_diff,
                                                    mean_diff):
    """Kernel backend (decode stack and Python layers; the fp32-activation int8 kernel, the W8A8 kernel, or
    dequantised F.linear) against the same int8 weights on plain torch ops, prefill and decode."""
    require_kernels(vectors=True)
    for folder in (tiny_model_dir, untied_dir):
        model = load(folder, "int8")
        model.set_backend(TorchBackend())
        ref = forward_logits(model, IDS)
        for stack in (True, False):
            model.set_backend(kernel_backend(max_int8_rows=int8_rows, max_w8a8_rows=w8a8_rows, decode_stack=stack))
            assert (model.prepared.stack is not None) == stack
            for got in (forward_logits(model, IDS), decode_logits(model, IDS)):
                diff = (got - ref).abs()
                assert diff.max() <= max_diff and diff.mean() <= mean_diff, (diff.max(), diff.mean())


@pytest.mark.parametrize("w8a8_rows", [64, 0], ids=["w8a8", "widen"])
def test_int8_decode_stack_is_bit_identical_to_the_python_layers(tiny_model_dir, w8a8_rows):
    require_kernels(vectors=True)
    model = load(tiny_model_dir, "int8")
    got = {}
    for stack in (True, False):
        model.set_backend(kernel_backend(decode_stack=stack, max_w8a8_rows=w8a8_rows))
        got[stack] = decode_logits(model, IDS[:12])
    assert torch.equal(got[True], got[False])


def test_int8_decode_takes_the_w8a8_kernel_only_where_asked_for(tiny_model_dir):
    """max_w8a8_rows > 0: the products run W8A8 (the stack's and the Python layers' logits both differ from the
    fp32-activation kernel's); the default (0: int8 activations fail the accuracy gate) keeps them off."""
    require_w8a8()
    model = load(tiny_model_dir, "int8")
    on, off = kernel_backend(max_w8a8_rows=64), kernel_backend()
    assert "linear_w8a8" in on.kernels() and "linear_w8a8" not in off.kernels() and "linear_int8" in off.kernels()
    got, copies = {}, {}
    for name, backend in (("on", on), ("off", off)):
        model.set_backend(backend)
        copies[name] = [w.packed for w in model.prepared.linears.values()] + [model.prepared.head.packed]
        got[name] = decode_logits(model, IDS[:12])
    assert not torch.equal(got["on"], got["off"])
    assert all(p is not None for p in copies["on"]) and all(p is None for p in copies["off"])


# measured with the fp32-activation kernel: top-1 0.95 / 0.975 and KL 0.00046 / 0.00026 on the tied / untied tiny
# model (40 positions, flat random logits, so near-ties flip); with W8A8 (the default on VNNI) top-1 1.0 / 1.0,
# KL 0.00061 / 0.00046; SmolLM2's figures: docs/performance.md (python -m bench.weight_quant)
TOP1_THRESHOLD = 0.9
KL_LIMIT = 0.005


def test_int8_agrees_with_bf16_teacher_forced(tiny_model_dir, untied_dir):
    """Top-1 agreement of int8 against bf16 weights over a teacher-forced sequence, and a small KL."""
    require_kernels(vectors=True)
    for folder in (tiny_model_dir, untied_dir):
        bf16, int8 = load(folder, "bfloat16"), load(folder, "int8")
        bf16.set_backend(kernel_backend())
        int8.set_backend(kernel_backend())
        ref, got = decode_logits(bf16, IDS), decode_logits(int8, IDS)
        agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()
        assert agree >= TOP1_THRESHOLD, agree
        assert kl < KL_LIMIT, kl
        assert not torch.equal(ref, got)  # the weights did change


def test_weight_dtype_option():
    assert EngineConfig().weight_dtype == "auto"
    with pytest.raises(ConfigError, match="weight_dtype must be one of auto, bfloat16, int8"):
        EngineConfig(weight_dtype="int3")
    assert quant.resolve_weight_dtype("auto") == "bfloat16"


def test_llm_generates_with_int8_weights(tiny_model_dir):
    """The option end to end: LLM(weight_dtype="int8") loads int8 weights, and each greedy first token is the
    argmax of that int8 model's own prefill logits (which differ from bf16's)."""
    require_kernels(vectors=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [IDS[:7], IDS[10:23], IDS[5:9]]
    logits = {}
    for weight_dtype in ("bfloat16", "int8"):
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", weight_dtype=weight_dtype, num_kv_blocks=64)
        model = llm.engine.runner.model
        assert model.weight_dtype == weight_dtype
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == 6 for o in outs)
        logits[weight_dtype] = [forward_logits(model, p)[-1] for p in prompts]
        assert [o.token_ids[0] for o in outs] == [int(x.argmax()) for x in logits[weight_dtype]]
    assert not any(torch.equal(a, b) for a, b in zip(logits["bfloat16"], logits["int8"]))
