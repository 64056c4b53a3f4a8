"""The LM head's logits in fp32 (Backend.lm_head): each CPU kernel keeps the fp32 sums its bf16 output rounds,
the kernel backend's head is torch's fp32 product, and logits that bf16 would tie are told apart, through the
engine's greedy picks too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.backends import CpuKernelBackend, TorchBackend
from engine.backends import weight_ops
from engine.backends.dispatch import ENGINES
from engine.backends.weight_ops import Weight
from engine.kernels import cpu_ext
from engine.model import quant
from tests.kernel_helpers import kernel_backend, kernel_calls, require_kernels  # noqa: F401 (fixtures)
from tests.test_weight_int4 import int4_weight


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels()


def operands(rows: int, n: int = 200, k: int = 100, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] bf16 and a weight [n, k] bf16 (100 = three 32-wide steps and a tail; 200 a partial block)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen).to(torch.bfloat16),
            (torch.randn(n, k, generator=gen) * 0.1).to(torch.bfloat16))


def weight_args(kernel: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The weight operands `kernel` takes, made from a bf16 weight as the model's loaders make them."""
    if kernel == "linear_bf16":
        return (weight,)
    if kernel in ("linear_int8", "linear_w8a8"):
        codes, scale = quant.quantize_rows(weight)
        return (codes if kernel == "linear_int8" else weight_ops.pack_w8a8(codes), scale)
    return int4_weight(weight.float())


@pytest.mark.parametrize("rows", [1, 3, 8, 11])  # one pass, a partial pass, a whole one, two passes
@pytest.mark.parametrize("kernel", ["linear_bf16", "linear_int8", "linear_w8a8", "linear_int4", "linear_w4a8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fp32_out_keeps_the_sums_the_bf16_output_rounds(kernel, rows, with_bias):
    x, weight = operands(rows, seed=rows)
    bias = (torch.randn(weight.shape[0]) * 0.1).to(torch.bfloat16) if with_bias else None
    args = weight_args(kernel, weight)
    sums = getattr(cpu_ext, kernel)(x, *args, bias, fp32_out=True)
    rounded = getattr(cpu_ext, kernel)(x, *args, bias)
    assert sums.dtype == torch.float32 and rounded.dtype == torch.bfloat16 and sums.shape == rounded.shape
    assert torch.equal(sums.to(torch.bfloat16), rounded)  # the same sums, rounded once (nearest even)
    assert not torch.equal(sums, rounded.float())  # and more than bf16 holds


@pytest.mark.parametrize("engine", ["tiles", "vectors"])
def test_packed_blocks_keep_the_fp32_sums(engine):
    if engine not in cpu_ext.matrix_engines():
        pytest.skip(f"no {engine} engine on this CPU")
    x, weight = operands(17, n=64, k=96)
    packed = cpu_ext.tile_pack(weight)
    sums = cpu_ext.tiled_linear(x, packed, None, engine, fp32_out=True)
    assert sums.dtype == torch.float32
    assert torch.equal(sums.to(torch.bfloat16), cpu_ext.tiled_linear(x, packed, None, engine))
    assert not torch.equal(sums, sums.to(torch.bfloat16).float())


def head(fmt: str, weight: torch.Tensor) -> Weight:
    """An LM head of this format as a backend takes it."""
    if fmt == "bf16":
        return Weight(weight)
    if fmt == "int8":
        codes, scale = quant.quantize_rows(weight)
        return Weight(codes, scale=scale)
    codes, scale = int4_weight(weight.float())
    return Weight(codes, scale=scale)


@pytest.mark.parametrize("rows", [1, 3, 8, 70])  # the GEMV, the int kernels' passes, past every kernel's limit
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_kernel_backend_head_is_the_fp32_product(fmt, rows):
    """The kernels' sums and torch's fp32 product of the same operands: equal up to the order of fp32 sums."""
    x, weight = operands(rows, n=300, k=576, seed=rows)
    w = head(fmt, weight)
    got = kernel_backend().lm_head(x, w)
    want = TorchBackend("cpu").lm_head(x, w)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def close_candidates(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 64] and a head [16, 64] whose logits are 20 for id 1 and 20.03125 for id 2 (zero elsewhere): one
    bf16 value, since bf16's steps are 0.125 between 16 and 32."""
    x = torch.zeros(rows, 64, dtype=torch.bfloat16)
    x[:, :2] = 1
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    weight[1:3, 0] = 20
    weight[2, 1] = 0.03125
    return x, weight


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("backend", ["torch", "kernels", "packed"])
def test_logits_that_bf16_would_tie_are_told_apart(backend, rows):
    x, weight = close_candidates(rows)
    assert (F.linear(x, weight).max(dim=-1).indices == 1).all()  # in bf16 a tie, broken towards the lower id
    packed = None
    if backend == "packed":
        if not cpu_ext.matrix_engines():
            pytest.skip("neither AMX tiles nor AVX-512 BF16 on this CPU")
        packed = cpu_ext.tile_pack(weight)
    chosen = TorchBackend("cpu") if backend == "torch" else kernel_backend()
    logits = chosen.lm_head(x, Weight(weight, packed=packed))
    assert (logits.max(dim=-1).indices == 2).all()
    assert (logits[:, 2] - logits[:, 1] == 0.03125).all()
    if packed is not None and rows > 1:
        assert (cpu_ext.tiled_linear_argmax(x, packed) == 2).all()


def test_greedy_engine_picks_from_fp32_logits(tiny_model_dir, monkeypatch, kernel_calls):
    """A greedy bf16 engine picks from the head's fp32 logits: the argmax taken as the packed head's results
    come out (2+ rows, packed blocks), else torch's max on Backend.lm_head's fp32 logits. Rows that ask for
    logprobs take the logits and pick the same tokens."""
    seen = []
    head_of = CpuKernelBackend.lm_head

    def recorded_head(self, *args):
        logits = head_of(self, *args)
        seen.append(logits.dtype)
        return logits

    off_the_head = CpuKernelBackend.greedy_tokens

    def fused_greedy(self, x, head):
        out = off_the_head(self, x, head)
        if out is not None:
            seen.append("fused")
        return out

    monkeypatch.setattr(CpuKernelBackend, "lm_head", recorded_head)
    monkeypatch.setattr(CpuKernelBackend, "greedy_tokens", fused_greedy)
    prompts = ["the cat", "a dog sat on", "1 2 3 4"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fast = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64)
    got = [o.token_ids for o in fast.generate(prompts, greedy)]
    assert seen and set(seen) <= {torch.float32, "fused"}
    table = fast.engine.runner.backend.dispatch  # three rows a step: the packed head where its table reads blocks
    assert ("fused" in seen) == (table.bf16.kernel(3) in ENGINES)
    assert ("fused" in seen) == ("tiled_linear_argmax_bf16" in kernel_calls.names())
    seen.clear()
    with_logprobs = fast.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                         logprobs=2))
    assert [o.token_ids for o in with_logprobs] == got and set(seen) == {torch.float32}


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_the_gates_memoised_reference_head_is_the_reference_to_the_bit(fmt):
    from bench.kernel_accuracy import MemoisedReference

    x, weight = operands(5, n=300, k=96)
    w = head(fmt, weight)
    memoised = MemoisedReference()
    want = TorchBackend("cpu").lm_head(x, w)
    for _ in range(2):  # the second call reads the kept chunks
        assert torch.equal(memoised.lm_head(x, w), want)
    assert memoised.chunks
