"""The product kernel on packed blocks (engine/kernels/tiled_linear.cpp), on each engine this CPU has (AMX
tiles, AVX-512 BF16 vectors), and where the model uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.backends.attention import AttentionMetadata
from engine.kernels import cpu_ext, packed_linear
from engine.kv.cache import KVCache
from engine.model.layers import Linear
from tests.kernel_helpers import kernel_backend, kernel_calls, kernel_model, reconfigure, require_kernels  # noqa: F401
from tests.test_decode_stack import assert_stack_matches_layers, qwen2_dir, stack_calls  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels(matrix_engine=True)


class OnEngine:
    """cpu_ext's products on packed blocks, on one engine."""

    def __init__(self, name: str) -> None:
        self.name = name

    def tiled_linear(self, x, packed, bias=None, fp32_out=False):
        return cpu_ext.tiled_linear(x, packed, bias, self.name, fp32_out)

    def tiled_linear_silu_mul(self, x, packed):
        return cpu_ext.tiled_linear_silu_mul(x, packed, self.name)

    def tiled_linear_argmax(self, x, packed):
        return cpu_ext.tiled_linear_argmax(x, packed, self.name)


@pytest.fixture(params=["tiles", "vectors"])
def engine(request) -> OnEngine:
    """The test runs on one engine (skipped where this CPU does not have it)."""
    if request.param not in cpu_ext.matrix_engines():
        pytest.skip(f"no {request.param} engine on this CPU")
    return OnEngine(request.param)


def operands(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return torch.randn(rows, k, generator=gen).to(torch.bfloat16), weight, bias


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rows", [2, 5, 16, 17, 33, 64, 128])
@pytest.mark.parametrize("n,k", [(48, 64), (960, 576), (576, 1536)], ids=["odd-blocks", "qkv", "down"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_product_is_x_times_w_transposed_rounded_once(rows, n, k, with_bias, engine):
    x, weight, bias = operands(rows, n, k, seed=rows + n)
    bias = bias if with_bias else None
    out = engine.tiled_linear(x, cpu_ext.tile_pack(weight), bias)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    exact = reference(x, weight, bias)
    # fp32 sums rounded once to bf16: within half a bf16 ulp of the exact value, plus fp32 summation error
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()
    # and torch's own bf16 product (also fp32 sums, another order) differs by at most one rounding step
    torch_out = F.linear(x, weight, bias).double()
    assert ((out.double() - torch_out).abs() <= torch_out.abs() * 2 ** -7 + 1e-4).all()


def test_each_row_is_independent_of_the_rest_of_the_batch(engine):
    x, weight, _ = operands(64, 960, 576)
    packed = cpu_ext.tile_pack(weight)
    whole = engine.tiled_linear(x, packed)
    for first, count in [(0, 2), (5, 3), (16, 17), (40, 24)]:
        assert torch.equal(engine.tiled_linear(x[first:first + count], packed), whole[first:first + count])


# Prefill chunks: rows past one slice of A (tiled_linear.cpp's run(): about 1 MiB of rows, 896 at K = 576, 320 at
# K = 1536), the last slice partial.
@pytest.mark.parametrize("rows", [200, 511, 1000])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)], ids=["qkv", "down"])
def test_prefill_sized_products_span_row_slices(rows, n, k, engine):
    x, weight, bias = operands(rows, n, k, seed=rows + k)
    out = engine.tiled_linear(x, cpu_ext.tile_pack(weight), bias)
    exact = reference(x, weight, bias)
    assert out.shape == (rows, n)
    assert ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4).all()


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536)], ids=["qkv", "down"])
def test_rows_are_independent_across_row_slices(n, k, engine):
    x, weight, bias = operands(1000, n, k, seed=k)
    packed = cpu_ext.tile_pack(weight)
    whole = engine.tiled_linear(x, packed, bias)
    for first, count in [(0, 2), (300, 40), (880, 40), (960, 40)]:  # 880..920 and 300..340 cross slice edges
        assert torch.equal(engine.tiled_linear(x[first:first + count], packed, bias), whole[first:first + count])


def test_model_prefill_chunks_take_the_packed_blocks_up_to_the_row_limit(tiny_model_dir, kernel_calls):
    model = kernel_model(tiny_model_dir, max_tiled_rows=300)
    weights = model.prepared.linears
    assert all(weights[layer.mlp.gate_up_proj].silu_fused.dim() == 4 and weights[layer.mlp.gate_up_proj].packed is None
               for layer in model.layers)
    assert all(w.packed.dim() == 4 for w in weights.values() if w.packed is not None)
    kernel_calls.clear()  # packing runs no product
    for rows in (200, 300, 301):
        meta = AttentionMetadata.build(4, [], [(list(range(80)), 0, rows)], True)
        model(torch.arange(rows) % 40 + 3, torch.arange(rows), meta, KVCache(model.cfg, 80, 4, torch.bfloat16).layers)
    per_forward = 3 * model.cfg.num_layers  # qkv, o, down of each layer
    rows_seen, fused_rows_seen = kernel_calls.rows("tiled_linear_bf16"), kernel_calls.rows("tiled_linear_silu_mul_bf16")
    assert rows_seen == [200] * per_forward + [300] * per_forward  # 301 rows: F.linear
    # the MLP's gate|up product with SiLU * up: the packed blocks at any row count
    assert fused_rows_seen == [rows for rows in (200, 300, 301) for _ in range(model.cfg.num_layers)]


def test_strided_rows_and_bad_operands(engine):
    x, weight, bias = operands(20, 96, 64)
    packed = cpu_ext.tile_pack(weight)
    wide = torch.zeros(20, 100, dtype=torch.bfloat16)
    wide[:, 3:67] = x
    assert torch.equal(engine.tiled_linear(wide[:, 3:67], packed, bias), engine.tiled_linear(x, packed, bias))
    assert engine.tiled_linear(x[:0], packed).shape == (0, 96)
    with pytest.raises(RuntimeError, match="same K"):
        engine.tiled_linear(torch.zeros(4, 96, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias"):
        engine.tiled_linear(x, packed, bias[:50])
    with pytest.raises(RuntimeError, match="N % 16"):
        cpu_ext.tile_pack(weight[:40])
    with pytest.raises(RuntimeError, match="K % 32"):
        cpu_ext.tile_pack(weight[:, :48].contiguous())


def test_pack_takes_blocks_where_the_shape_allows_else_onednn():
    _, weight, _ = operands(2, 96, 64)
    backend = kernel_backend()
    assert backend.pack(weight).dim() == 4
    assert backend.pack(weight[:40]).dim() != 4  # N % 16 != 0: oneDNN's packing (or none)
    assert kernel_backend(tiled_packing=False).pack(weight).dim() != 4


def gate_up_projections(model) -> list[Linear]:
    return [layer.mlp.gate_up_proj for layer in model.layers]


def test_model_products_and_decode_stack_run_on_the_packed_blocks(tiny_model_dir, stack_calls):
    model = kernel_model(tiny_model_dir)
    weights = model.prepared.linears
    gate_ups = gate_up_projections(model)
    packs = [weights[m].packed for m in model.modules() if isinstance(m, Linear) and m not in gate_ups]
    packs += [weights[layer.mlp.gate_up_proj].silu_fused for layer in model.layers] + [model.prepared.head.packed]
    assert packs and all(p is not None and p.dim() == 4 for p in packs)
    assert_stack_matches_layers(model, [0, 1, 2], stack_calls)  # stack and Python layers: same kernel, same bits


def test_decode_stack_still_matches_the_layers_on_onednn_packing(tiny_model_dir, stack_calls):
    model = kernel_model(tiny_model_dir, tiled_packing=False)
    assert all(model.prepared.linears[m].packed.dim() == 2 for m in model.modules() if isinstance(m, Linear))
    # the fused product needs the blocks
    assert all(model.prepared.linears[layer.mlp.gate_up_proj].silu_fused is None for layer in model.layers)
    assert_stack_matches_layers(model, [0, 1, 2], stack_calls)


def test_decode_stack_with_biases_on_the_packed_blocks(qwen2_dir, stack_calls):
    model = kernel_model(qwen2_dir)
    qkv = model.prepared.linears[model.layers[0].self_attn.qkv_proj]
    assert qkv.bias is not None and qkv.packed.dim() == 4
    assert_stack_matches_layers(model, [0, 1, 2], stack_calls)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 33, 64, 128, 1000])
@pytest.mark.parametrize("n,k", [(48, 64), (4096, 576)], ids=["odd-blocks", "head-like"])
def test_fused_argmax_is_the_argmax_of_the_fp32_product(rows, n, k, engine):
    x, weight, _ = operands(rows, n, k, seed=rows + n)
    packed = cpu_ext.tile_pack(weight)
    assert torch.equal(engine.tiled_linear_argmax(x, packed), fp32_argmax(engine, x, packed))


def fp32_argmax(engine: OnEngine, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """torch's max(dim) over the product's fp32 sums."""
    return engine.tiled_linear(x, packed, fp32_out=True).max(dim=-1).indices


def on_1_2_and_3_threads(run):
    """[run() on 1 thread, on 2, on 3]; torch's thread count restored after."""
    previous = torch.get_num_threads()
    try:
        return [torch.set_num_threads(threads) or run() for threads in (1, 2, 3)]
    finally:
        torch.set_num_threads(previous)


def test_fused_argmax_takes_the_first_of_equal_maxima_and_nan_first_on_any_thread_count(engine):
    """Equal columns far apart (different pairs, different threads' claims): the first wins; a NaN column wins
    over every number, the first NaN over later ones; the same answer on 1, 2 and 3 threads."""
    x, weight, _ = operands(64, 1024, 64, seed=9)
    weight[40] = weight[1000] = weight[700] = weight[3] * 3  # columns 40, 700 and 1000: equal and largest
    weight[[3, 9]] = -weight[3]
    x[5, 0] = float("nan")  # row 5: every column NaN: the first is 0
    packed_plain = cpu_ext.tile_pack(weight)
    weight[512, 7] = weight[900, 7] = float("nan")  # columns 512 and 900 NaN in every row (NaN times anything)
    packed_nan = cpu_ext.tile_pack(weight)
    answers = on_1_2_and_3_threads(lambda: (engine.tiled_linear_argmax(x, packed_plain),
                                            engine.tiled_linear_argmax(x, packed_nan)))
    plain, with_nan = answers[0]
    for other in answers[1:]:
        assert torch.equal(other[0], plain) and torch.equal(other[1], with_nan)
    assert torch.equal(plain, fp32_argmax(engine, x, packed_plain))
    assert torch.equal(with_nan, fp32_argmax(engine, x, packed_nan))
    assert plain[5] == 0 and with_nan[5] == 0
    assert (with_nan[[r for r in range(64) if r != 5]] == 512).all()  # column 512 is NaN for every other row
    ties = [r for r in range(64) if r != 5 and plain[r] in (40, 700, 1000)]
    assert ties and all(plain[r] == 40 for r in ties)  # equal maxima: the first column


# ---- the MLP's gate|up product with SiLU * up off its results (tiled_linear_silu_mul) ----------------------------

def gate_up_operands(rows: int, width: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] and a gate|up weight [2 * width, k], scaled so that the gates span SiLU's curved part."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(2 * width, k, generator=gen) * 2 / k ** 0.5).to(torch.bfloat16)
    return torch.randn(rows, k, generator=gen).to(torch.bfloat16), weight


# Rows within a tile, across tiles, across row slices of A (896 rows at K = 576) and past a 2048-token step.
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 64, 200, 1000, 2100])
@pytest.mark.parametrize("width,k", [(48, 64), (1536, 576)], ids=["small", "smollm2"])
def test_fused_gate_up_is_silu_mul_of_the_product_to_the_bit(rows, width, k, engine):
    x, weight = gate_up_operands(rows, width, k, seed=rows + width)
    out = engine.tiled_linear_silu_mul(x, packed_linear.pack_gate_up(weight))
    product = engine.tiled_linear(x, cpu_ext.tile_pack(weight))  # [rows, 2 * width]
    assert out.shape == (rows, width) and out.dtype == torch.bfloat16
    assert torch.equal(out, cpu_ext.silu_mul(product))
    gate, up = product.chunk(2, dim=-1)
    assert torch.equal(out, F.silu(gate) * up) or (out != F.silu(gate) * up).float().mean() < 1e-3  # torch's ops


def test_fused_gate_up_rows_are_independent_of_the_batch(engine):
    x, weight = gate_up_operands(1000, 1536, 576, seed=3)
    packed = packed_linear.pack_gate_up(weight)
    whole = engine.tiled_linear_silu_mul(x, packed)
    for first, count in [(0, 2), (7, 9), (880, 40), (960, 40)]:
        assert torch.equal(engine.tiled_linear_silu_mul(x[first:first + count], packed), whole[first:first + count])


def test_fused_gate_up_packing_and_bad_operands(engine):
    x, weight = gate_up_operands(4, 48, 64)
    packed = packed_linear.pack_gate_up(weight)
    # gate block j, then up block j: the packed copy is tile_pack of the weight with its blocks interleaved
    interleaved = torch.cat([weight[16 * j:16 * j + 16] if i % 2 == 0 else weight[48 + 16 * j:48 + 16 * j + 16]
                             for j in range(3) for i in range(2)])
    assert torch.equal(packed, cpu_ext.tile_pack(interleaved))
    assert engine.tiled_linear_silu_mul(x[:0], packed).shape == (0, 48)
    with pytest.raises(RuntimeError, match="even number"):
        engine.tiled_linear_silu_mul(x, cpu_ext.tile_pack(weight[:80]))
    with pytest.raises(RuntimeError, match="same K"):
        engine.tiled_linear_silu_mul(torch.zeros(4, 32, dtype=torch.bfloat16), packed)
    assert packed_linear.pack_gate_up(weight[:80]) is None  # 40 gate rows: not whole blocks
    assert packed_linear.pack_gate_up(weight.float()) is None
    assert kernel_backend().pack_gate_up(weight) is not None
    assert kernel_backend(fused_gate_up=False).pack_gate_up(weight) is None


def test_model_mlp_takes_the_fused_product_from_two_rows(tiny_model_dir, kernel_calls):
    """One row: the GEMV on the plain weight, then silu_mul; two or more: the fused product. The MLP's output is
    the same either way as the unfused ops give it (tiled_linear then silu_mul)."""
    model = kernel_model(tiny_model_dir)
    mlp, prepared = model.layers[0].mlp, model.prepared
    x = torch.randn(9, model.cfg.hidden_size).to(torch.bfloat16)
    out = mlp(x, prepared)
    plain = cpu_ext.silu_mul(cpu_ext.tiled_linear(x, cpu_ext.tile_pack(mlp.gate_up_proj.weight)))
    assert torch.equal(out, mlp.down_proj(plain, prepared))
    one_row = cpu_ext.silu_mul(cpu_ext.linear_bf16(x[:1], mlp.gate_up_proj.weight))
    assert torch.equal(mlp(x[:1], prepared), mlp.down_proj(one_row, prepared))
    assert kernel_calls.rows("tiled_linear_silu_mul_bf16") == [9]
    reconfigure(model, fused_elementwise=False)  # torch's ops after the plain product
    prepared = model.prepared
    gate, up = prepared.backend.linear(x, prepared.linears[mlp.gate_up_proj]).chunk(2, dim=-1)
    expected = mlp.down_proj(F.silu(gate) * up, prepared)
    kernel_calls.clear()
    assert torch.equal(mlp(x, prepared), expected)
    assert kernel_calls.names() == ["tiled_linear_bf16"] * 2  # gate|up and down: no SiLU kernel, no fused product


def test_decode_stack_matches_the_layers_without_the_fused_gate_up(tiny_model_dir, stack_calls):
    model = kernel_model(tiny_model_dir, fused_gate_up=False)
    assert all(model.prepared.linears[layer.mlp.gate_up_proj].silu_fused is None
               and model.prepared.linears[layer.mlp.gate_up_proj].packed.dim() == 4 for layer in model.layers)
    assert_stack_matches_layers(model, [0, 1, 2], stack_calls)


def test_products_are_the_same_on_1_2_and_3_threads(engine):
    """Each pair of column blocks is one thread's whole work, results handed out while the next pair runs:
    which thread takes which pairs, and in what order, does not change a bit."""
    x, weight = gate_up_operands(333, 1536, 576, seed=4)
    fused, plain = packed_linear.pack_gate_up(weight), cpu_ext.tile_pack(weight)
    results = on_1_2_and_3_threads(lambda: (engine.tiled_linear_silu_mul(x, fused), engine.tiled_linear(x, plain)))
    for silu, product in results[1:]:
        assert torch.equal(silu, results[0][0]) and torch.equal(product, results[0][1])


def test_auto_takes_the_first_engine_and_an_engine_not_here_is_refused():
    engines = cpu_ext.matrix_engines()
    x, weight, bias = operands(40, 96, 64, seed=21)
    packed = cpu_ext.tile_pack(weight)
    assert torch.equal(cpu_ext.tiled_linear(x, packed, bias), cpu_ext.tiled_linear(x, packed, bias, engines[0]))
    with pytest.raises(ValueError, match="engine must be one of"):
        cpu_ext.tiled_linear(x, packed, bias, "amx")
    for missing in {"tiles", "vectors"} - set(engines):
        for call in (lambda: cpu_ext.tiled_linear(x, packed, bias, missing),
                     lambda: cpu_ext.tiled_linear_argmax(x, packed, missing),
                     lambda: cpu_ext.tiled_linear_silu_mul(x, packed, missing)):
            with pytest.raises(RuntimeError, match="no (AMX tiles|AVX-512 BF16) in this build"):
                call()
        with pytest.raises(ValueError, match="not available here"):
            kernel_backend(matrix_engine=missing)


@pytest.mark.parametrize("rows", [2, 64, 333])
def test_tiles_and_vectors_agree_within_one_rounding(rows):
    if len(cpu_ext.matrix_engines()) < 2:
        pytest.skip("one engine on this CPU: nothing to compare")
    x, weight, bias = operands(rows, 960, 576, seed=rows)
    packed = cpu_ext.tile_pack(weight)
    tiles = cpu_ext.tiled_linear(x, packed, bias, "tiles").double()
    vectors = cpu_ext.tiled_linear(x, packed, bias, "vectors").double()
    assert ((tiles - vectors).abs() <= tiles.abs() * 2 ** -7 + 1e-4).all()
