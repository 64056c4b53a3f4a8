"""The AVX-512 int4 GEMM (engine/kernels/int4_linear.cpp linear_int4_gemm): the weight-only int4 kernel's result to
the bit at every row count (passes of up to 8 rows, tails of 1-7, 1-3 blocks of channels left over), odd shapes,
fp32 sums kept, and within one bf16 rounding of the float64 product of x and the dequantised weights; and the
backend and the decode stack run it where a table names it."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_ext
from tests.kernel_helpers import require_kernels, routed_backend
from tests.test_weight_int4 import assert_rounded_once, dequantised, int4_weight, product_case

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 33, 64]
SHAPES = [(200, 576), (33, 100), (1, 17), (130, 15), (96, 1536), (70, 300), (16, 32)]
INT4_GEMM_LIMIT = 8  # its place among CpuKernelBackend.stack_limits' row limits


def require_gemm() -> None:
    require_kernels()
    if not cpu_ext.int4_gemm_vectorized():
        pytest.skip("the int4 GEMM was built without AVX-512 (it then runs the weight-only kernel's loops)")
    if not cpu_ext.int4_vectorized():
        pytest.skip("the weight-only int4 kernel it is checked against was built without AVX2")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_is_the_weight_only_kernel_to_the_bit(n, k, with_bias):
    require_gemm()
    for rows in ROWS:
        x, packed, scales, bias = product_case(rows, n, k, with_bias)
        for fp32_out in (False, True):
            want = cpu_ext.linear_int4(x, packed, scales, bias, fp32_out)
            got = cpu_ext.linear_int4_gemm(x, packed, scales, bias, fp32_out)
            assert got.dtype == want.dtype and torch.equal(got, want), (rows, n, k, fp32_out)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("n,k", [(200, 576), (33, 100), (1, 17), (130, 15)])
def test_gemm_is_the_exact_product_rounded_once(rows, n, k):
    """One wrong code or a row read from the wrong pass moves a result by about sum |x w| / K, far past the bound."""
    require_gemm()
    x, packed, scales, bias = product_case(rows, n, k, True)
    got = cpu_ext.linear_int4_gemm(x, packed, scales, bias)
    weights = dequantised(packed, scales, k)
    ref = x.double() @ weights.T + bias.double()
    assert_rounded_once(got, ref, x, weights, (rows, n), sum_error=2 ** -7)


def test_gemm_rows_are_independent_and_fp32_rows_are_taken():
    require_gemm()
    torch.manual_seed(11)
    x = torch.randn(21, 300).to(torch.bfloat16)
    packed, scales = int4_weight(torch.randn(70, 300))
    batched = cpu_ext.linear_int4_gemm(x, packed, scales)
    for r in (0, 7, 8, 15, 16, 20):
        assert torch.equal(cpu_ext.linear_int4_gemm(x[r:r + 1], packed, scales), batched[r:r + 1])
    assert torch.equal(cpu_ext.linear_int4_gemm(x.float(), packed, scales), batched)
    assert torch.equal(cpu_ext.linear_int4_gemm(x[:0], packed, scales), batched[:0])
    with pytest.raises(RuntimeError, match="groups"):
        cpu_ext.linear_int4_gemm(x, packed, scales[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="bias"):
        cpu_ext.linear_int4_gemm(x, packed, scales, torch.zeros(3))


def test_a_table_naming_the_gemm_runs_it(monkeypatch):
    require_gemm()
    backend, rows_seen = routed_backend(monkeypatch, "linear_int4_gemm", "int4",
                                        [(1, "int4"), (3, "int4_gemm"), (9, "linear")])
    assert "linear_int4_gemm" in backend.kernels()
    packed, scales = int4_weight(torch.randn(70, 100) * 0.05)
    w = backend.prepare_linear(packed, None, scales)
    for rows in (1, 3, 8, 9):
        backend.linear(torch.randn(rows, 100).to(torch.bfloat16), w)
    assert rows_seen == [3, 8]
    assert backend.stack_limits(5)[INT4_GEMM_LIMIT] == 5 and backend.stack_limits(2)[INT4_GEMM_LIMIT] == 0
