"""Every GGUF block type held exactly: the int8g format (engine/model/gguf_int8g.py) against gguf's own dequantiser,
its kernels against an fp32 product with those values, `auto`'s choice per type, and a file that loads with it."""
from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from bench.gguf_dequant import random_blocks
from engine import LLM, SamplingParams
from engine.backends import weight_ops
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.kernels import cpu_ext
from engine.model import quant
from engine.model.gguf_int8g import SPLITTERS, repack_int8g
from engine.model.gguf_repack import repack_int4
from engine.model.layers import Linear
from engine.model.loader import load_model, resolve_model
from tests import test_gguf_quants as mixed
from tests.kernel_helpers import require_kernels

Q = gguf.GGMLQuantizationType
TYPES = [t.name for t in SPLITTERS]
F16 = np.float16


def file_blocks(qtype: Q, rows: int = 24, k: int = 512, seed: int = 0) -> np.ndarray:
    """Random `qtype` blocks of a [rows, k] tensor (uint8 [rows, bytes per row]), scales of a real model's size."""
    rng = np.random.default_rng(seed)
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    scales = (rng.uniform(1e-4, 1e-2, 256) * rng.choice([-1, 1], 256)).astype(F16)
    return random_blocks(rng, qtype, rows * k // block_size, scales).reshape(rows, -1)


def int8g_weight(data: np.ndarray, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's blocks as an int8g weight (codes [ceil(N / 16), G, 256], scales [1 or 2, G, N])."""
    repack = repack_int8g(data, qtype)
    offset = None if repack.offset is None else torch.from_numpy(repack.offset)
    return weight_ops.int8g_pack(torch.from_numpy(repack.codes), torch.from_numpy(repack.scale), offset,
                                 repack.codes.shape[1])


@pytest.mark.parametrize("qtype", TYPES)
def test_int8g_holds_each_type_as_gguf_dequantises_it_bit_for_bit(qtype):
    data = file_blocks(Q[qtype])
    codes, scales = int8g_weight(data, Q[qtype])
    ours = weight_ops.int8g_rows(codes, scales, slice(0, data.shape[0]), 512, torch.float32).numpy()
    theirs = gguf.quants.dequantize(data, Q[qtype])
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_int8g_blocks_hold_a_pair_of_k_for_16_channels_side_by_side():
    """codes[b, g, 32 p + 2 c + j] = q[16 b + c, 16 g + 2 p + j], zeros past N and K; scales [S, G, N]; rows put in
    pieces that cross blocks land where a whole pack puts them, and read back by any index."""
    gen = torch.Generator().manual_seed(5)
    n, k = 37, 40  # a block's tail of 5 channels, a group's tail of 8 k
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale, offset = torch.rand(2, n, 3, generator=gen)
    codes, scales = weight_ops.int8g_pack(q, scale, offset, k)
    assert codes.shape == (3, 3, 256) and scales.shape == (2, 3, n)
    blocks = codes.view(3, 3, 8, 16, 2)
    for row, col in [(0, 0), (0, 1), (5, 17), (16, 0), (36, 39), (21, 30)]:
        assert codes[row // 16, col // 16, 32 * (col % 16 // 2) + 2 * (row % 16) + col % 2] == q[row, col]
    assert not blocks[2, :, :, 5:].any() and not blocks[:, 2, 4:].any()  # channels 37-47, k 40-47
    assert torch.equal(scales[0], scale.T) and torch.equal(scales[1], offset.T)
    pieces = torch.zeros_like(codes), torch.zeros_like(scales)
    for first, last in [(0, 10), (10, 33), (33, 37)]:
        weight_ops.int8g_put(*pieces, first, q[first:last], scale[first:last], offset[first:last])
    assert torch.equal(pieces[0], codes) and torch.equal(pieces[1], scales)
    picked = weight_ops.int8g_rows(codes, scales, torch.tensor([36, 0, 17]), k, torch.float64)
    want = (torch.nn.functional.pad(q, (0, 8)).double().view(n, 3, 16) * scale.double().unsqueeze(2)
            + offset.double().unsqueeze(2)).view(n, 48)[[36, 0, 17], :k]
    assert torch.allclose(picked, want, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_holds_q4_0_and_q4_1_exactly(qtype):
    """The types auto keeps int4 (equal values: int4's 8 d - 8 d is +0 where gguf's 0 d may be -0)."""
    repack = repack_int4(file_blocks(Q[qtype]), Q[qtype])
    codes = np.stack([repack.codes & 0x0F, repack.codes >> 4], axis=2).reshape(24, -1, 32).astype(np.float32)
    ours = codes * repack.scale.astype(np.float32)[..., None] + repack.offset.astype(np.float32)[..., None]
    assert repack.inexact == 0
    assert np.array_equal(ours.reshape(24, -1), gguf.quants.dequantize(file_blocks(Q[qtype]), Q[qtype]))


def test_int4_rounds_some_q4_k_scales_which_auto_takes_for_its_bytes():
    """Q4_K in int4 rounds some sub-blocks' d * sc and dmin * m to fp16; auto takes it there all the same (a third of
    int8g's bytes a decode step reads), and int8g wherever a Q4_K tensor is fused with another type."""
    assert repack_int4(file_blocks(Q.Q4_K), Q.Q4_K).inexact > 0
    assert quant.exact_format({"Q4_K"}) == "int4"


@pytest.mark.parametrize("kinds,chosen", [
    ({"Q4_0"}, "int4"), ({"Q4_1"}, "int4"), ({"Q4_0", "Q4_1"}, "int4"), ({"Q4_K"}, "int4"), ({"Q6_K"}, "int8g"),
    ({"Q8_0"}, "int8g"), ({"Q5_K"}, "int8g"), ({"Q2_K"}, "int8g"), ({"Q3_K"}, "int8g"), ({"Q5_0"}, "int8g"),
    ({"Q5_1"}, "int8g"), ({"Q4_K", "Q6_K"}, "int8g"), ({"Q4_0", "Q6_K"}, "int8g"), ({"Q4_K", "Q4_0"}, "int4"), ({"F16"}, "bfloat16"),
    ({"BF16"}, "bfloat16"), ({"F32"}, "bfloat16"), ({"Q4_K", "F16"}, "bfloat16")])
def test_auto_chooses_the_format_that_holds_each_type_exactly(kinds, chosen):
    assert quant.exact_format(kinds) == chosen


@pytest.fixture(scope="module")
def kernels():
    require_kernels()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_kernel_is_the_fp32_product_with_the_files_values(kernels, qtype, rows):
    """linear_int8g against x W^T in float64 on gguf's values: the weights are exact, the activations bf16 (exact
    in fp32), so only the fp32 sums' order and rounding part them (relative 1e-5 of the sum of |terms|)."""
    data = file_blocks(Q[qtype], rows=40, k=512, seed=1)
    codes, scales = int8g_weight(data, Q[qtype])
    weights = torch.from_numpy(gguf.quants.dequantize(data, Q[qtype])).double()
    x = torch.randn(rows, 500, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x_padded = torch.nn.functional.pad(x.double(), (0, 12))
    want, bound = x_padded @ weights.T, x_padded.abs() @ weights.abs().T
    got = cpu_ext.linear_int8g(x, codes, scales, None, True)
    assert got.dtype == torch.float32 and torch.all((got.double() - want).abs() <= 1e-5 * bound + 1e-30)
    bias = torch.randn(40)
    rounded = cpu_ext.linear_int8g(x, codes, scales, bias)
    assert torch.equal(rounded, (got + bias).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5])
def test_kernel_sums_bf16_and_fp32_activations_of_the_same_values_alike(kernels, rows):
    """linear_int8g keeps bf16 activations as bf16 and widens them in registers, fp32 ones as they are: the same
    values give the same sums, bit for bit, at a K whose fp32 row fills L1 (8192) and past it."""
    data = file_blocks(Q["Q6_K"], rows=24, k=8448, seed=3)
    codes, scales = int8g_weight(data, Q["Q6_K"])
    x = torch.randn(rows, 8448, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(cpu_ext.linear_int8g(x, codes, scales, None, True),
                       cpu_ext.linear_int8g(x.float(), codes, scales, None, True))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K"])
def test_dequantised_rows_are_the_files_values_rounded_once_to_bf16(kernels, qtype):
    data = file_blocks(Q[qtype], rows=40, k=512)
    codes, scales = int8g_weight(data, Q[qtype])
    want = torch.from_numpy(gguf.quants.dequantize(data, Q[qtype])).to(torch.bfloat16)[5:30, :500]
    assert torch.equal(cpu_ext.dequantize_int8g(codes, scales, 500, 5, 30), want)
    assert torch.equal(weight_ops.int8g_rows(codes, scales, slice(5, 30), 500, torch.bfloat16), want)
    exact = torch.from_numpy(gguf.quants.dequantize(data, Q[qtype]))[5:30, :500]  # what linear32 multiplies by
    assert torch.equal(cpu_ext.dequantize_int8g(codes, scales, 500, 5, 30, fp32_out=True), exact)
    assert torch.equal(weight_ops.int8g_rows(codes, scales, slice(5, 30), 500, torch.float32), exact)


INT8G_LIMIT = 7  # its place among stack_limits' row limits


def test_backend_routes_int8g_by_rows_and_the_stack_limits_say_so(kernels):
    backend = CpuKernelBackend()
    data = file_blocks(Q.Q6_K, rows=40, k=512)
    codes, scales = int8g_weight(data, Q.Q6_K)
    w = backend.prepare_linear(codes, None, scales)
    weights = torch.from_numpy(gguf.quants.dequantize(data, Q.Q6_K))
    for rows in (1, 100):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got, want = backend.linear(x, w).float(), x.float() @ weights.T  # bf16 results: 2^-8 of the largest
        assert (got - want).abs().max() <= 2 ** -7 * want.abs().max()
    assert backend.stack_limits(1)[INT8G_LIMIT] == 1 and backend.stack_limits(100)[INT8G_LIMIT] == 0


# a Q4_K_M download's mix: Q4_K, with attn_v and ffn_down Q6_K in some layers, a Q6_K head; and a Q4_0 layer
MIXED = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K,
         **{f"blk.{i}.{part}.weight": Q.Q4_K for i in range(mixed.LAYERS) for part in mixed.SHAPES},
         "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
         **{f"blk.1.{part}.weight": Q.Q4_0 for part in ("attn_q", "attn_k", "attn_v")}}


def test_auto_loads_each_tensor_exactly_and_says_so(tmp_path, caplog):
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, MIXED)
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
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weight dtype auto")]
    assert lines == ["weight dtype auto: projections int4 (the file's codes and scales repacked; Q4_K's sub-block "
                     "scales to fp16): 7 Q4_K, 3 Q4_0; int8g (the file's codes as int8, fp32 scales per 16 or 32, "
                     "exactly): 2 Q4_K, 2 Q6_K; LM head Q6_K -> int8g"]
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    qkv = model.layers[0].self_attn.qkv_proj
    for module, name, rows in ((model.layers[0].mlp.down_proj, "blk.0.ffn_down.weight", None),
                               (qkv, "blk.0.attn_q.weight", mixed.SHAPES["attn_q"][0]),  # Q4_K, in the fused int8g
                               (model.lm_head, "output.weight", None)):
        tensor = reader[name]
        k = tensor.shape[0]
        ours = weight_ops.int8g_rows(module.weight, module.weight_scale,
                                     slice(0, rows or weight_ops.int8g_channels(module.weight_scale)),
                                     int(k), torch.float32)
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        ours, theirs = ours.numpy().view(np.uint32), theirs.view(np.uint32)
        if module is qkv:  # q's rows in the model's rotary order, which the file permutes: the same rows
            ours, theirs = np.unique(ours, axis=0), np.unique(theirs, axis=0)
        assert np.array_equal(ours, theirs), name
    flat = weight_ops.int8g_flat_shape
    assert flat(model.layers[0].mlp.down_proj.weight_scale)[0] == 1  # Q6_K: no offsets kept
    assert flat(qkv.weight_scale)[0] == 2  # Q4_K's minimums
    for module in (model.layers[0].mlp.down_proj, qkv, model.lm_head):  # Q6_K's scales differ a group of 16
        assert weight_ops.int8g_scale_group(module.weight_scale, module.weight.shape[1] * 16) == 16


def test_q8_0_keeps_one_scale_per_32_values_and_every_value(tmp_path):
    """Q8_0's fp16 d holds for a block of 32: the load keeps it once a pair of groups (1.125 bytes a value, not
    1.25), and the values stay gguf's own."""
    path = tmp_path / "q8.gguf"
    mixed.write_mixed_gguf(path, dict.fromkeys(MIXED, Q.Q8_0))
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    int8g = {name: m for name, m in model.named_modules() if isinstance(m, Linear)} | {"lm_head": model.lm_head}
    for name, module in int8g.items():
        k = module.weight.shape[1] * 16
        n, pairs = weight_ops.int8g_channels(module.weight_scale), -(-k // 32)
        blocked = n % 16 == 0  # in the codes' blocks where N allows (the tiny vocabulary's head: 300 channels)
        assert module.weight_scale.shape == ((n // 16, pairs, 1, 16) if blocked else (1, pairs, n)), name
    for module, tensor in ((model.layers[1].mlp.down_proj, reader["blk.1.ffn_down.weight"]),
                           (model.lm_head, reader["output.weight"])):
        ours = weight_ops.int8g_rows(module.weight, module.weight_scale,
                                     slice(0, weight_ops.int8g_channels(module.weight_scale)), int(tensor.shape[0]),
                                     torch.float32)
        theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


def test_auto_generates_the_greedy_tokens_of_bf16_weights_from_the_same_file(tmp_path):
    """On the tiny random model the two part only at a near-tie of its logits (past the tokens compared here): the
    weights differ by bf16's rounding of the file's values, which auto keeps whole."""
    require_kernels()
    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, MIXED)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[1, 5, 9, 3], [2, 7]]
    tokens = {}
    for fmt in ("auto", "bfloat16"):
        llm = LLM(str(path), dtype="bfloat16", weight_dtype=fmt, num_kv_blocks=64, block_size=8)
        tokens[fmt] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["auto"] == tokens["bfloat16"]
