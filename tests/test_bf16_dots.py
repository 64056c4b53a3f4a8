"""The int4 and int8g products on AVX-512 BF16 dot products (engine/kernels/bf16_dots.h: int4_linear.cpp
linear_int4_bf16, int8_grouped.cpp linear_int8g_bf16): the fp32 sums within their own rounding of the float64 product
of x and the file's weights (never rounded to bf16; int8g: gguf's own dequantised values of every block type), the
bf16 result those sums rounded once, at every row count (int4: up to 8 rows widened in registers, more in buffered
passes of 1-6 rows split evenly), odd channel counts, K off a group, K past one chunk of widened groups; each row on
its own; clear errors; and the backend and the decode stack's limits send a table's rows to each."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine.backends import weight_ops
from engine.kernels import cpu_ext
from tests.kernel_helpers import require_kernels, routed_backend
from tests.test_gguf_exact import TYPES, file_blocks, int8g_weight
from tests.test_weight_int4 import dequantised, int4_weight, product_case

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 32, 37, 64]
# (N, K): one pair of 16-channel blocks and a lone one, channels past N in the last block, K off a group (padded
# codes), K under one group, 66 groups (two chunks of widened groups)
SHAPES = [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536), (48, 2112)]
INT4_BF16_LIMIT, INT8G_BF16_LIMIT = 9, 10  # their places among CpuKernelBackend.stack_limits' row limits


def require_bf16_dots() -> None:
    require_kernels()
    if not (cpu_ext.int4_bf16_vectorized() and cpu_ext.int8g_bf16_vectorized()):
        pytest.skip("built without AVX-512 BF16 (the ops then run linear_int4_gemm and linear_int8g)")


def assert_fp32_sums(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, bias, where) -> None:
    """got (fp32) within fp32 additions' rounding of the float64 product: 2^-16 of sum |x w| covers a few dozen
    groups' sums; one wrong code or a row from the wrong pass lands far outside it (about sum |x w| / K)."""
    ref = x.double() @ weights.T + (0 if bias is None else bias.double())
    bound = (x.double().abs() @ weights.abs().T) * 2 ** -16 + ref.abs() * 2 ** -23
    assert got.dtype == torch.float32 and ((got.double() - ref).abs() <= bound).all(), where


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_sums_are_the_exact_product_and_bf16_is_them_rounded_once(n, k, with_bias):
    require_bf16_dots()
    for rows in ROWS:
        x, packed, scales, bias = product_case(rows, n, k, with_bias)
        sums = cpu_ext.linear_int4_bf16(x, packed, scales, bias, True)
        assert_fp32_sums(sums, x, dequantised(packed, scales, k), bias, (rows, n, k))
        rounded = cpu_ext.linear_int4_bf16(x, packed, scales, bias)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, sums.to(torch.bfloat16)), (rows, n, k)


def test_each_row_is_its_own_whatever_pass_it_lands_in():
    """21 rows run as buffered passes of 6, 5, 5, 5 and 3 rows as one direct pass: a row's bits are the same in
    both (one chain a row); one and two rows run two chains a row, the same bits as each other."""
    require_bf16_dots()
    torch.manual_seed(11)
    x = torch.randn(21, 300).to(torch.bfloat16)
    x[:, :7] *= 1000  # a group spanning magnitudes, so that the order of its additions shows
    packed, scales = int4_weight(torch.randn(70, 300))
    batched = cpu_ext.linear_int4_bf16(x, packed, scales, None, True)
    for r in range(0, 21, 3):
        assert torch.equal(cpu_ext.linear_int4_bf16(x[r:r + 3], packed, scales, None, True), batched[r:r + 3]), r
    pair = cpu_ext.linear_int4_bf16(x[:2], packed, scales, None, True)
    for r in range(2):
        assert torch.equal(cpu_ext.linear_int4_bf16(x[r:r + 1], packed, scales, None, True), pair[r:r + 1]), r
    assert torch.equal(cpu_ext.linear_int4_bf16(x[:0], packed, scales), batched[:0].to(torch.bfloat16))


def test_nan_and_inf_reach_the_output():
    require_bf16_dots()
    x, packed, scales, _ = product_case(3, 40, 64, False)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    out = cpu_ext.linear_int4_bf16(x, packed, scales)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert (out[2].isinf() | out[2].isnan()).all()


def test_bad_arguments_are_refused_by_name():
    require_bf16_dots()
    x, packed, scales, _ = product_case(2, 70, 100, False)
    with pytest.raises(RuntimeError, match="groups"):
        cpu_ext.linear_int4_bf16(x, packed, scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="bias"):
        cpu_ext.linear_int4_bf16(x, packed, scales, torch.zeros(3))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        cpu_ext.linear_int4_bf16(x.float(), packed, scales)


def test_a_table_naming_it_runs_it_and_the_stack_limits_say_so(monkeypatch):
    require_bf16_dots()
    backend, rows_seen = routed_backend(monkeypatch, "linear_int4_bf16", "int4",
                                        [(1, "int4_gemm"), (4, "int4_bf16"), (33, "linear")])
    assert "linear_int4_bf16" in backend.kernels()
    packed, scales = int4_weight(torch.randn(70, 100) * 0.05)
    w = backend.prepare_linear(packed, None, scales)
    for rows in (1, 3, 4, 32, 33):
        backend.linear(torch.randn(rows, 100).to(torch.bfloat16), w)
    assert rows_seen == [4, 32]
    assert backend.stack_limits(8)[INT4_BF16_LIMIT] == 8 and backend.stack_limits(2)[INT4_BF16_LIMIT] == 0


# ---- int8g -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_int8g_sums_are_the_product_with_gguf_values(qtype):
    """Every block type the int8g format holds (scales only, or scales and offsets), rows 1-33 (tails of a block's
    16 channels: 40 = 2 x 16 + 8), against x times gguf's own dequantised weights."""
    require_bf16_dots()
    data = file_blocks(gguf.GGMLQuantizationType[qtype], rows=40, k=512)
    codes, scales = int8g_weight(data, gguf.GGMLQuantizationType[qtype])
    weights = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])).double()
    bias = torch.randn(40)
    for rows in (1, 2, 5, 6, 7, 13, 33):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        sums = cpu_ext.linear_int8g_bf16(x, codes, scales, bias, True)
        assert_fp32_sums(sums, x, weights, bias, (qtype, rows))
        assert torch.equal(cpu_ext.linear_int8g_bf16(x, codes, scales, bias), sums.to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [(40, 100), (1, 17), (70, 4200)])  # K off a group; one channel; 263 groups: 3 chunks
def test_int8g_odd_shapes_and_rows_on_their_own(n, k):
    require_bf16_dots()
    gen = torch.Generator().manual_seed(n + k)
    groups = -(-k // 16)
    rows = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale, offset = torch.rand(2, n, groups, generator=gen) * 0.01 - 0.002
    codes, scales = weight_ops.int8g_pack(rows, scale, offset, k)
    weights = (torch.nn.functional.pad(rows, (0, groups * 16 - k)).double().view(n, groups, 16)
               * scale.double().unsqueeze(2) + offset.double().unsqueeze(2)).view(n, -1)[:, :k]
    x = torch.randn(9, k, generator=gen).to(torch.bfloat16)
    sums = cpu_ext.linear_int8g_bf16(x, codes, scales, None, True)
    assert_fp32_sums(sums, x, weights, None, (n, k))
    for r in (0, 3, 6):  # 9 rows buffered (passes of 5 and 4), 3 direct: one chain a row, the same bits
        assert torch.equal(cpu_ext.linear_int8g_bf16(x[r:r + 3], codes, scales, None, True), sums[r:r + 3])
    pair = cpu_ext.linear_int8g_bf16(x[:2], codes, scales, None, True)  # two chains a row at one and two rows
    assert_fp32_sums(pair, x[:2], weights, None, (n, k))
    for r in range(2):
        assert torch.equal(cpu_ext.linear_int8g_bf16(x[r:r + 1], codes, scales, None, True), pair[r:r + 1])
    with pytest.raises(RuntimeError, match="x must be bf16"):
        cpu_ext.linear_int8g_bf16(x.float(), codes, scales)
    with pytest.raises(RuntimeError, match="scales must be"):
        cpu_ext.linear_int8g_bf16(x, codes, torch.cat([scales, scales[:, :1]], 1))  # neither 16 nor 32 a scale


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 21])
def test_int8g_argmax_is_torchs_max_of_the_sums(rows):
    """linear_int8g_bf16_argmax against torch's max over linear_int8g_bf16's fp32 sums, direct and buffered rows, 50
    channels (a block's tail): ties go to the lower column (channels 7 and 33, in other blocks, are one weight and
    the best of most rows), and a NaN channel wins every row it reaches."""
    require_bf16_dots()
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (50, 100), generator=gen, dtype=torch.int8)
    scale = torch.rand(50, 7, generator=gen) * 0.01
    scale[7] += 0.05
    q[33], scale[33] = q[7], scale[7]
    codes, scales = weight_ops.int8g_pack(q, scale, None, 100)
    x = torch.randn(rows, 100, generator=gen).to(torch.bfloat16)
    x[0] = 0  # all sums 0: a tie of every column, the first wins
    sums = cpu_ext.linear_int8g_bf16(x, codes, scales, None, True)
    want = sums.max(dim=1).indices
    assert torch.equal(cpu_ext.linear_int8g_bf16_argmax(x, codes, scales), want) and want[0] == 0
    assert rows == 1 or (want[1:] == 7).any()
    q[7] //= 2
    codes, scales = weight_ops.int8g_pack(q, scale, None, 100)  # 33 now above 7 where the two were best
    best = cpu_ext.linear_int8g_bf16_argmax(x, codes, scales)
    assert torch.equal(best, cpu_ext.linear_int8g_bf16(x, codes, scales, None, True).max(dim=1).indices)
    assert rows == 1 or (best[1:] == 33).any()
    scale[45, 3] = float("nan")
    codes, scales = weight_ops.int8g_pack(q, scale, None, 100)
    assert (cpu_ext.linear_int8g_bf16_argmax(x, codes, scales) == 45).all()


def test_greedy_tokens_take_the_int8g_argmax_where_the_route_is_int8g_bf16(monkeypatch):
    """The backend's greedy pick off an int8g head: the argmax kernel where the table names int8g_bf16 for the rows,
    torch's max of the logits otherwise (None: the caller's path), the same tokens either way."""
    require_bf16_dots()
    backend, rows_seen = routed_backend(monkeypatch, "linear_int8g_bf16_argmax", "int8g",
                                        [(1, "int8g"), (3, "int8g_bf16"), (17, "linear")])
    codes, scales = int8g_weight(file_blocks(gguf.GGMLQuantizationType.Q8_0, rows=40, k=512),
                                 gguf.GGMLQuantizationType.Q8_0)
    head = backend.prepare_linear(codes, None, scales)
    for rows in (2, 3, 16, 17):
        hidden = torch.randn(rows, 512).to(torch.bfloat16)
        picked = backend.greedy_tokens(hidden, head)
        if rows in (3, 16):
            assert torch.equal(picked, backend.lm_head(hidden, head).max(dim=1).indices)
        else:
            assert picked is None
    assert rows_seen == [3, 16] and "lm_head_argmax" in backend.kernels()


def test_a_table_naming_int8g_bf16_runs_it_and_the_stack_limits_say_so(monkeypatch):
    require_bf16_dots()
    backend, rows_seen = routed_backend(monkeypatch, "linear_int8g_bf16", "int8g",
                                        [(1, "int8g"), (3, "int8g_bf16"), (17, "linear")])
    assert "linear_int8g_bf16" in backend.kernels()
    codes, scales = int8g_weight(file_blocks(gguf.GGMLQuantizationType.Q8_0, rows=24, k=512),
                                 gguf.GGMLQuantizationType.Q8_0)
    w = backend.prepare_linear(codes, None, scales)
    for rows in (1, 2, 3, 16, 17):
        backend.linear(torch.randn(rows, 512).to(torch.bfloat16), w)
    assert rows_seen == [3, 16]
    assert backend.stack_limits(8)[INT8G_BF16_LIMIT] == 8 and backend.stack_limits(2)[INT8G_BF16_LIMIT] == 0


@pytest.mark.parametrize("n,k,offsets", [(40, 100, True), (33, 64, False), (80, 4200, True), (1, 17, False),
                                         (48, 100, False)])
def test_int8g_scales_per_32_and_blocked_give_the_bits_of_the_same_scales_per_16(n, k, offsets):
    """A file's factors that hold for 32 values kept once a pair of groups (pair_int8g_scales), and the scales in
    the codes' blocks where N is a multiple of 16 (block_int8g_scales): every kernel, the dequantised rows and the
    greedy pick give the same bits as the same factors written for each group of 16, [S, G, N]."""
    require_bf16_dots()
    gen = torch.Generator().manual_seed(n * k)
    groups, pairs = -(-k // 16), -(-k // 32)
    rows = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    factors = torch.rand(2, n, pairs, generator=gen) * 0.01 - 0.002
    scale, offset = factors.repeat_interleave(2, dim=2)[:, :, :groups]
    codes, per16 = weight_ops.int8g_pack(rows, scale, offset if offsets else None, k)
    per32 = weight_ops.pair_int8g_scales(per16)
    assert per32 is not None and per32.shape == (per16.shape[0], pairs, n)
    assert weight_ops.int8g_scale_group(per16, k) == 16
    assert weight_ops.int8g_scale_group(per32, k) == (32 if k > 16 else 16)
    forms = [per32]
    for scales in (per16, per32):
        blocked = weight_ops.block_int8g_scales(scales)
        assert (blocked is None) == (n % 16 != 0)
        if blocked is not None:
            assert blocked.shape == (n // 16, scales.shape[1], scales.shape[0], 16)
            assert torch.equal(blocked.permute(2, 1, 0, 3).reshape(scales.shape), scales)
            assert weight_ops.int8g_flat_shape(blocked) == tuple(scales.shape)
            assert weight_ops.int8g_channels(blocked) == n and weight_ops.is_int8g(codes, blocked)
            forms.append(blocked)
    x = torch.randn(11, k, generator=gen).to(torch.bfloat16)
    rows = torch.tensor([n - 1, 0, n // 2])
    for scales in forms:
        for m in (1, 2, 5, 8, 11):  # one and two chains, one direct pass, buffered passes
            assert torch.equal(cpu_ext.linear_int8g_bf16(x[:m], codes, scales, None, True),
                               cpu_ext.linear_int8g_bf16(x[:m], codes, per16, None, True))
            assert torch.equal(cpu_ext.linear_int8g(x[:m], codes, scales, None, True),
                               cpu_ext.linear_int8g(x[:m], codes, per16, None, True))
            assert torch.equal(cpu_ext.linear_int8g_bf16_argmax(x[:m], codes, scales),
                               cpu_ext.linear_int8g_bf16_argmax(x[:m], codes, per16))
        assert torch.equal(cpu_ext.dequantize_int8g(codes, scales, k, 0, n),
                           cpu_ext.dequantize_int8g(codes, per16, k, 0, n))
        assert torch.equal(weight_ops.int8g_rows(codes, scales, rows, k, torch.float32),
                           weight_ops.int8g_rows(codes, per16, rows, k, torch.float32))


def test_int8g_scales_stay_per_16_where_a_pair_differs_in_any_bit():
    scales = torch.ones(1, 4, 3)
    assert weight_ops.pair_int8g_scales(scales).shape == (1, 2, 3)
    scales[0, 3, 2] = 1.0000001
    assert weight_ops.pair_int8g_scales(scales) is None
    zeros = torch.zeros(2, 2, 5)
    zeros[1, 1, 0] = -0.0  # equal as numbers, not as bits: the file's sign of a zero stays
    assert weight_ops.pair_int8g_scales(zeros) is None
    assert weight_ops.pair_int8g_scales(torch.ones(1, 1, 3)) is None  # one group: nothing to pair
    odd = torch.arange(15.0).view(1, 5, 3).repeat_interleave(2, dim=1)[:, :5]  # the last group alone
    assert torch.equal(weight_ops.pair_int8g_scales(odd), odd[:, 0::2])
    with pytest.raises(ValueError, match="neither 16 nor 32"):
        weight_ops.int8g_scale_group(torch.ones(1, 5, 3), 100)
