"""The accuracy gate's rules (bench/kernel_accuracy.py), without a model: the KL bound and its floor, and the
`floor` and `floor32` kernel sets' tables and their memoised products."""
from __future__ import annotations

import gguf
import pytest
import torch

from bench.kernel_accuracy import (FLOOR_CAP, FLOOR_MARGIN, MAX_KL_MEAN, MemoisedFloor, MemoisedFloor32, forced_backend,
                                   within_bound)
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.dispatch import FORMATS
from engine.backends.weight_ops import Weight
from engine.model import quant
from tests.test_gguf_exact import file_blocks, int8g_weight
from tests.test_weight_int4 import int4_weight


def test_under_the_bound_passes_without_a_floor():
    assert within_bound(MAX_KL_MEAN, None)
    assert not within_bound(MAX_KL_MEAN * 1.01, None)


def test_past_the_bound_a_set_passes_only_near_a_floor_under_its_cap():
    floor = MAX_KL_MEAN * 1.2
    assert within_bound(floor * FLOOR_MARGIN, floor)
    assert within_bound(floor * 0.9, floor)  # better than the floor
    assert not within_bound(floor * FLOOR_MARGIN * 1.01, floor)
    assert not within_bound(FLOOR_CAP * 1.05, FLOOR_CAP * 1.05)  # a shared kernel that far off fails on its own


@pytest.mark.parametrize("floor,linear", [("floor", "linear"), ("floor32", "linear32")])
def test_the_floor_sets_give_every_product_of_every_row_count_to_f_linear(floor, linear):
    table = forced_backend(floor).dispatch
    for fmt in FORMATS:
        assert table.route(fmt).kernels == (linear,), fmt


def floor_weights() -> dict[str, Weight]:
    """An int8, an int4 and an int8g weight [200, 512], made as the loaders make them."""
    weight = (torch.randn(200, 512, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16)
    codes, scale = quant.quantize_rows(weight)
    packed, scales = int4_weight(weight.float())
    q6_k = gguf.GGMLQuantizationType.Q6_K
    g_codes, g_scales = int8g_weight(file_blocks(q6_k, rows=200), q6_k)
    return {"int8": Weight(codes, scale=scale), "int4": Weight(packed, scale=scales),
            "int8g": Weight(g_codes, scale=g_scales)}


@pytest.mark.parametrize("rows", [1, 4, 70])
def test_the_memoised_floor_computes_the_floor_tables_products_to_the_bit(rows):
    """The floor set memoises its dequantised weights (MemoisedFloor): the same bits as the floor's table run by
    the kernel backend itself, which dequantises at every call; twice, so the kept chunks are read too."""
    floor = forced_backend("floor")
    plain = CpuKernelBackend(floor.config)
    assert isinstance(floor, MemoisedFloor) and plain.dispatch == floor.dispatch
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    for fmt, w in floor_weights().items():
        product = getattr(plain, f"linear_{fmt}")(x, w)
        head = plain.lm_head(x, w) if fmt != "int8g" else None
        for _ in range(2):
            assert torch.equal(getattr(floor, f"linear_{fmt}")(x, w), product), fmt
            if head is not None:
                assert torch.equal(floor.lm_head(x, w), head), fmt
    assert floor.reference.chunks


@pytest.mark.parametrize("rows", [1, 70])
def test_the_memoised_floor32_computes_its_tables_products_to_the_bit(rows):
    """floor32 keeps the fp32 chunks: the same bits as its table run by the kernel backend itself (linear32, and
    the LM head in fp32), which widens or dequantises at every call; twice, so the kept chunks are read too."""
    floor = forced_backend("floor32")
    plain = CpuKernelBackend(floor.config)
    assert isinstance(floor, MemoisedFloor32) and plain.dispatch == floor.dispatch
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    weights = floor_weights() | {"float": Weight((torch.randn(200, 512) * 0.05).to(torch.bfloat16))}
    for fmt, w in weights.items():
        product, head = plain.linear(x, w), plain.lm_head(x, w)
        for _ in range(2):
            assert torch.equal(floor.linear(x, w), product), fmt
            assert torch.equal(floor.lm_head(x, w), head), fmt
    assert floor.reference.chunks
