"""The compiled CPU kernels (engine/kernels/cpu_ext.*) against torch references, alone and inside the model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.core.builder import build_engine_core
from engine import LLM, SamplingParams
from engine.backends import attention
from engine.backends.attention import AttentionMetadata
from engine.backends import CpuKernelBackend, CpuKernelConfig, TorchBackend
from engine.backends.torch_ops import apply_rotary
from engine.backends.weight_ops import Weight
from engine.config import EngineConfig, ModelConfig
from engine.kernels import cpu_ext, packed_linear
from engine.kv.cache import KVCache
from engine.kv.formats import PageWrites, QuantizedPages, page_format
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.layers import Linear
from engine.model.llama import build_model
from engine.model.rope import RotaryEmbedding
from tests.kernel_helpers import ONEDNN, kernel_backend, kernel_calls, require_kernels  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def kernels() -> None:
    """Every test here needs the compiled kernels: checked when a test runs, not when the module is collected."""
    require_kernels()


@pytest.fixture
def backend() -> CpuKernelBackend:
    return CpuKernelBackend()


def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])  # passes of up to 8 rows; 11 = one of 8 + one of 3
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_fp32_reference_within_bf16_rounding(rows, with_bias):
    torch.manual_seed(rows)
    x, w = bf16(rows, 100), bf16(200, 100, scale=0.1)  # 100 = three 32-wide steps + a scalar tail
    bias = bf16(200) if with_bias else None
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    got = cpu_ext.linear_bf16(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    # One rounding to bf16 at the end (relative 2**-8) plus fp32 summation-order noise.
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-4)


def test_linear_rows_past_one_pass_equal_each_row_alone():
    """70 rows (passes of 8 over slices of 64 weight rows, 300 of them: a partial slice): each row's sums are the
    one-row product's to the bit, whichever pass and slice computed them."""
    torch.manual_seed(3)
    x, w = bf16(70, 100), bf16(300, 100, scale=0.1)
    batched = cpu_ext.linear_bf16(x, w, None, True)
    for r in (0, 7, 8, 63, 64, 69):
        assert torch.equal(cpu_ext.linear_bf16(x[r:r + 1], w, None, True), batched[r:r + 1])


def test_linear_takes_the_gemv_up_to_its_row_limit_and_bf16_models_only(tiny_model_dir, backend, kernel_calls):
    w = bf16(8, 16)
    limit = backend.config.max_gemv_rows
    for rows in range(1, limit + 2):
        x = bf16(rows, 16)
        assert torch.equal(backend.linear(x, Weight(w)),
                           cpu_ext.linear_bf16(x, w) if rows <= limit else F.linear(x, w))
    assert kernel_calls.rows("linear_bf16") == [r for r in range(1, limit + 1) for _ in range(2)]  # limit + 1: F.linear
    kernel_calls.clear()
    kernel_backend(max_gemv_rows=0).linear(bf16(1, 16), Weight(w))
    assert kernel_calls == []
    with pytest.raises(ValueError, match="bf16"):
        _model(tiny_model_dir, torch.float32)[1].set_backend(backend)  # decided once: no fp32 model on the kernels


def reference_decode_attention(q, k_pages, v_pages, tables, lens, scale):
    """SDPA in fp32 over each row's context, gathered from its pages."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        used = tables[b, : (n + k_pages.shape[1] - 1) // k_pages.shape[1]]
        keys = k_pages[used].flatten(0, 1)[:n].float().transpose(0, 1)[None]  # [1, Hkv, n, D]
        values = v_pages[used].flatten(0, 1)[:n].float().transpose(0, 1)[None]
        query = q[b].float()[None, :, None, :]  # [1, Hq, 1, D]
        out.append(F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


CONTEXT_LENS = [1, 15, 16, 17, 70, 300]  # one token, a block -1, a full block, one past it, several, many


def scattered_problem(batch, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """q, pages, block tables and unequal context lengths over scattered blocks; every page slot outside
    the contexts is NaN, and every table entry past a context an invalid block id: neither may be read."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([CONTEXT_LENS[(i * 5 + seed) % len(CONTEXT_LENS)] for i in range(batch)])
    needed = (lens + block_size - 1) // block_size
    num_blocks = int(needed.sum()) + 7
    order = torch.randperm(num_blocks, generator=gen)  # blocks scattered through the pool, in no order
    tables = torch.full((batch, int(needed.max()) + 2), 10 ** 9, dtype=torch.long)
    inside = torch.zeros(num_blocks, block_size, dtype=torch.bool)  # slots holding a context token
    for b, start in enumerate(torch.cumsum(needed, 0) - needed):
        tables[b, : needed[b]] = order[start: start + needed[b]]
        positions = torch.arange(int(lens[b]))
        inside[tables[b, positions // block_size], positions % block_size] = True
    k_pages, v_pages = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
                        .masked_fill(~inside[:, :, None, None], float("nan")).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(torch.bfloat16)
    return q, k_pages, v_pages, tables, lens


# fp32 math in both, from the same bf16 inputs: they differ by fp32 summation order and exp (~1e-6 relative)
# before the one rounding of the output to bf16, which alone reaches half an ulp (2**-8 relative just above a
# power of two). So: one ulp (rtol 2**-7), and a small atol for outputs near zero (fp32 cancellation, ~1e-6
# of the values' scale). A wrong or missing token moves outputs by percents.
ATTENTION_TOLERANCE = dict(rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (6, 1, 48), (4, 2, 256)],
                         ids=["MHA", "GQA-smollm2", "MQA-tail-chunk", "GQA-wide-head"])
@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_decode_attention_matches_sdpa_over_gathered_pages(num_heads, num_kv_heads, head_dim, batch):
    q, k_pages, v_pages, tables, lens = scattered_problem(batch, num_heads, num_kv_heads, head_dim,
                                                           seed=batch + 4)  # batch 1: the 300-token row
    got = cpu_ext.decode_attention_bf16(q, k_pages, v_pages, tables, lens, head_dim ** -0.5)
    ref = reference_decode_attention(q, k_pages, v_pages, tables, lens, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert not got.isnan().any()  # no NaN slot or block past a context was read
    torch.testing.assert_close(got.float(), ref, **ATTENTION_TOLERANCE)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_decode_attention_merges_rows_split_between_threads(threads):
    """Below 8 items a thread, each thread takes an equal share of all tokens, so a row's context may be split
    between threads and merged from softmax statistics: one long row over 3 and 5 shares, and a mixed batch,
    match the reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch, seed in ((1, 5), (7, 3)):  # seed 5: the one row is the 300-token context
            q, k_pages, v_pages, tables, lens = scattered_problem(batch, 6, 2, 64, block_size=8, seed=seed)
            got = cpu_ext.decode_attention_bf16(q, k_pages, v_pages, tables, lens, 0.125)
            ref = reference_decode_attention(q, k_pages, v_pages, tables, lens, 0.125)
            torch.testing.assert_close(got.float(), ref, **ATTENTION_TOLERANCE)
    finally:
        torch.set_num_threads(previous)


def test_decode_attention_of_many_items_gives_the_same_bits_on_any_thread_count():
    """At 8+ (row, kv head) items a thread, threads claim whole items as they free up: no item is cut, so the
    bits cannot depend on how many threads ran or which took what."""
    previous = torch.get_num_threads()
    q, k_pages, v_pages, tables, lens = scattered_problem(64, 9, 3, 64, seed=11)
    try:
        outputs = []
        for threads in (1, 2, 3, 2):
            torch.set_num_threads(threads)
            outputs.append(cpu_ext.decode_attention_bf16(q, k_pages, v_pages, tables, lens, 0.125))
    finally:
        torch.set_num_threads(previous)
    ref = reference_decode_attention(q, k_pages, v_pages, tables, lens, 0.125)
    torch.testing.assert_close(outputs[0].float(), ref, **ATTENTION_TOLERANCE)
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_decode_attention_rejects_a_context_longer_than_its_table():
    q, k_pages, v_pages, tables, lens = scattered_problem(2, 4, 2, 64)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_ext.decode_attention_bf16(q, k_pages, v_pages, tables[:, :1], lens.clamp(min=17), 0.125)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between bf16 tensors of the same signs (the bit patterns are then ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def torch_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# The fused kernels round every intermediate to bf16 where the torch ops store one, so they agree bit for bit
# except where an fp32 sum order (RMSNorm's mean) or exp's last bit (SiLU) differs and flips a rounding: one
# bf16 ulp of an intermediate, at most two of the output after the next product's rounding.
def assert_matches_torch_chain(got, ref):
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    assert ulp_distance(got, ref).max() <= 2
    assert (got == ref).float().mean() >= 0.999


@pytest.mark.parametrize("rows,width", [(1, 576), (64, 576), (300, 100), (3, 5)])  # 300 rows: split over threads
def test_rms_norm_with_fused_residual_add_matches_torch_ops(rows, width):
    torch.manual_seed(rows)
    x, residual = bf16(rows, width, scale=3.0), bf16(rows, width, scale=10.0)
    weight = (torch.rand(width) * 2).to(torch.bfloat16)
    normed, total = cpu_ext.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(total, residual + x)  # one bf16 add: exact
    assert_matches_torch_chain(normed, torch_rms_norm(residual + x, weight, 1e-5))
    normed, same = cpu_ext.rms_norm(x, weight, 1e-5)
    assert same is x or same.data_ptr() == x.data_ptr()
    assert_matches_torch_chain(normed, torch_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows,width", [(1, 1536), (64, 1536), (5, 37)])  # 37: a 16-lane tail
def test_silu_mul_matches_torch_ops(rows, width):
    torch.manual_seed(width)
    gate_up = bf16(rows, 2 * width, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches_torch_chain(cpu_ext.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("rows,head_dim", [(1, 64), (64, 64), (9, 20)])  # 20: half a head is 10 lanes
def test_rotary_in_place_is_bit_identical_to_apply_rotary(rows, head_dim):
    num_heads, num_kv_heads = 9, 3
    torch.manual_seed(rows)
    qkv = bf16(rows, (num_heads + 2 * num_kv_heads) * head_dim)
    cos, sin = RotaryEmbedding(head_dim, 4096, 10000.0, None).lookup(torch.randint(0, 4096, (rows,)),
                                                                     torch.bfloat16)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    ref_q = apply_rotary(q.reshape(rows, num_heads, head_dim), cos, sin)
    ref_k = apply_rotary(k.reshape(rows, num_kv_heads, head_dim), cos, sin)
    ref_v = v.clone()
    cpu_ext.rotary_(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    assert torch.equal(q.reshape(rows, num_heads, head_dim), ref_q)
    assert torch.equal(k.reshape(rows, num_kv_heads, head_dim), ref_k)
    assert torch.equal(v, ref_v)  # the value heads are left alone


def _model(folder, dtype):
    cfg = read_hf_config(folder)
    return cfg, build_model(cfg, iter_hf_weights(folder), dtype)


def test_bf16_model_with_kernels_matches_torch_ops(tiny_model_dir, kernel_calls):
    """Prefill chunks, then decode steps: logits with the kernels on stay within bf16 noise of the eager
    model's on the same pages (and the kernels did run, in the fast model only)."""
    require_kernels(vectors=True)  # these paths run only where the kernels have AVX-512
    cfg, eager = _model(tiny_model_dir, torch.bfloat16)
    _, fast = _model(tiny_model_dir, torch.bfloat16)
    backend = kernel_backend(decode_stack=False)  # the Python layers, whose kernel calls the spies see
    fast.set_backend(backend)
    block = 4
    prompts = [[5, 9, 33, 2, 7, 100, 3], [11, 12, 13], [400, 401, 402, 403, 404, 405, 406, 407, 408]]
    logits = {}
    for name, model, kernels_on in (("eager", eager, False), ("fast", fast, True)):
        kv = KVCache(cfg, 32, block, torch.bfloat16)
        tables = [list(range(10 * i + 9, 10 * i - 1, -1)) for i in range(len(prompts))]
        rows = []
        for table, ids in zip(tables, prompts):  # prefill each prompt
            meta = AttentionMetadata.build(block, [], [(table, 0, len(ids))], kernels_on)
            model(torch.tensor(ids), torch.arange(len(ids)), meta, kv.layers)
        for step in range(3):  # then decode: the first two together, the third alone
            for group in ([0, 1], [2]):
                positions = [len(prompts[i]) + step for i in group]
                meta = AttentionMetadata.build(block, [(tables[i], p + 1) for i, p in zip(group, positions)], [],
                                               kernels_on)
                hidden = model(torch.tensor([7 + step] * len(group)), torch.tensor(positions), meta, kv.layers)
                rows.append(model.compute_logits(hidden))
        logits[name] = torch.cat(rows)
    # 9 forwards (3 prefills, 6 decode steps). The GEMV serves the products of one row: each projection (4 a
    # layer) and the head of the 3 one-sequence decode steps; the packed weights those of 2+ rows: the 3
    # two-sequence decode steps and the 3 prefills (no head there), but for the MLP's gate|up product where
    # the packed blocks run here (AMX or AVX-512 BF16): that one and SiLU * up are then one fused call; the
    # attention kernel every decode step, one sequence or two; the elementwise kernels every forward.
    layers = cfg.num_layers
    fused = int(fast.prepared.linears[fast.layers[0].mlp.gate_up_proj].silu_fused is not None)
    assert fused == bool(cpu_ext.matrix_engines())
    assert backend.attends_in_place and packed_linear.onednn_available()
    names = {"linear_bf16": "linear_bf16", "decode_attention_bf16": "decode_attention_bf16",
             "rms_norm": "rms_norm_bf16", "silu_mul": "silu_mul_bf16", "tiled_linear_silu_mul":
             "tiled_linear_silu_mul_bf16", "rotary_": "rotary_bf16_"}
    calls = {name: kernel_calls.count(kernel) for name, kernel in names.items()}
    calls["packed"] = kernel_calls.count("tiled_linear_bf16") + kernel_calls.count(ONEDNN)
    head = int(fast.prepared.head.packed.dim() == 4)  # else oneDNN's copy, which rounds: two-row logits, the GEMV
    assert calls == {"linear_bf16": 3 * (4 * layers + 1) + 3 * (1 - head),
                     "packed": 3 * (4 * layers + head) + 3 * 4 * layers - fused * 6 * layers,
                     "decode_attention_bf16": 6 * layers, "rms_norm": 9 * (2 * layers + 1),
                     "silu_mul": (9 - fused * 6) * layers, "tiled_linear_silu_mul": fused * 6 * layers,
                     "rotary_": 9 * layers}
    ref = logits["eager"]
    assert (logits["fast"] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (logits["fast"].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_kernel_choices_follow_the_config(kernel_calls):
    require_kernels(vectors=True)  # these paths run only where the kernels have AVX-512
    q, k_pages, v_pages, tables, lens = scattered_problem(2, 4, 2, 64)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=2, num_decode_seqs=2,
                             decode_block_tables=tables, decode_context_lens=lens, use_kernels=True)
    assert CpuKernelBackend().decode_attention(q, k_pages, v_pages, meta, 0.125) is not None
    one = kernel_backend(max_attention_seqs=1)
    assert one.decode_attention(q, k_pages, v_pages, meta, 0.125) is None  # two sequences: gather + SDPA
    meta.num_decode_seqs = 1
    assert one.decode_attention(q, k_pages, v_pages, meta, 0.125) is not None
    assert kernel_calls.rows("decode_attention_bf16") == [2, 2]
    assert CpuKernelBackend().elementwise and CpuKernelBackend().fused_gate_up == bool(cpu_ext.matrix_engines())
    off = kernel_backend(fused_elementwise=False)
    # SiLU * up fused into the gate|up product is an elementwise kernel too, and the stack runs them all
    assert not off.elementwise and not off.fused_gate_up and not off.stacks
    kernel_calls.clear()
    x, residual, weight = bf16(4, 64), bf16(4, 64), bf16(64)
    torch_ops = TorchBackend()
    assert torch.equal(off.add_rms_norm(x, residual, weight, 1e-5)[0],
                       torch_ops.add_rms_norm(x, residual, weight, 1e-5)[0])
    gate_up_weight = bf16(32, 64)
    gate, up = off.linear(x, Weight(gate_up_weight)).chunk(2, dim=-1)
    assert torch.equal(off.gate_up_silu(x, off.prepare_gate_up(gate_up_weight, None)), F.silu(gate) * up)  # torch's
    assert "rms_norm_bf16" not in kernel_calls.names() and "silu_mul_bf16" not in kernel_calls.names()
    with pytest.raises(ValueError, match="max_gemv_rows"):
        CpuKernelConfig(max_gemv_rows=-1)
    with pytest.raises(ValueError, match="max_prompt_attention_tokens"):
        CpuKernelConfig(max_prompt_attention_tokens=cpu_ext.KERNEL_MAX_PROMPT_TOKENS + 1)


def test_fp32_model_is_untouched_by_the_kernel_switch(tiny_model_dir):
    """The kernels apply to bf16 only: an fp32 engine with them on is bit-identical to enforce_eager."""
    prompts = ["the cat sat", "hello there world"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    texts = []
    for eager in (False, True):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, enforce_eager=eager)
        texts.append([o.token_ids for o in llm.generate(prompts, params)])
    assert texts[0] == texts[1]


def test_enforce_eager_switches_the_kernels_off(tiny_model_dir):
    require_kernels(vectors=True)  # these paths run only where the kernels have AVX-512
    on = build_engine_core(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16))
    off = build_engine_core(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16,
                                         enforce_eager=True))
    assert type(on.runner.backend) is CpuKernelBackend and on.runner.model.backend is on.runner.backend
    # the head has a packed copy where the table this machine measured reads one
    assert (on.runner.model.prepared.head.packed is not None) == (on.runner.backend.packing is not None)
    assert type(off.runner.backend) is TorchBackend and off.runner.model.backend is off.runner.backend
    assert off.runner.model.prepared.head.packed is None and off.runner.model.prepared.stack is None


def test_verification_rows_through_the_kernel_match_the_causal_segment(tiny_model_dir, kernel_calls):
    """A sequence's last token + 3 drafts, verified as decode rows with growing context (what the runner does
    at batch 1 with the kernels on) gives the logits of the causal-segment path, within bf16 noise."""
    require_kernels(vectors=True)  # these paths run only where the kernels have AVX-512
    cfg, model = _model(tiny_model_dir, torch.bfloat16)
    model.set_backend(kernel_backend(decode_stack=False))  # the Python layers, whose kernel calls the spy sees
    block, prompt, drafts = 4, [5, 9, 33, 2, 7, 100, 3, 8, 41], [12, 13, 14, 15]
    table = [9, 3, 7, 1, 5]
    logits = {}
    for as_rows in (False, True):
        kv = KVCache(cfg, 12, block, torch.bfloat16)
        model(torch.tensor(prompt), torch.arange(len(prompt)), AttentionMetadata.build(block, [], [(table, 0, 9)],
                                                                                        True), kv.layers)
        start = len(prompt)
        if as_rows:
            meta = AttentionMetadata.build(block, [(table, start + j + 1) for j in range(4)], [], True,
                                           num_decode_seqs=1)
        else:
            meta = AttentionMetadata.build(block, [], [(table, start, 4)], True)
        hidden = model(torch.tensor(drafts), torch.arange(start, start + 4), meta, kv.layers)
        logits[as_rows] = model.compute_logits(hidden)
    # the rows version went through the kernel, all four rows at once
    assert kernel_calls.rows("decode_attention_bf16") == [4] * cfg.num_layers
    ref = logits[False]
    assert (logits[True] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.equal(logits[True].argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("rows", [2, 5, 64, 128])
def test_packed_weights_give_f_linear_bit_for_bit(rows, backend, kernel_calls):
    require_kernels(onednn=True)
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(200, 96, generator=gen) * 0.1).to(torch.bfloat16)
    bias = torch.randn(200, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    packed = backend.pack(weight)  # 200 rows: not whole 16-row blocks, so oneDNN's packing
    assert packed is not None and packed.dim() == 2 and 2 <= rows <= backend.max_packed_rows(packed)
    assert torch.equal(backend.linear(x, Weight(weight, bias=bias, packed=packed)), F.linear(x, weight, bias))
    assert torch.equal(backend.linear(x, Weight(weight, packed=packed)), F.linear(x, weight))
    assert kernel_calls.rows(ONEDNN) == [rows, rows]  # both products on the packed copy
    assert backend.pack(weight.float()) is None  # bf16 only
    too_many = backend.max_packed_rows(packed) + 1
    kernel_calls.clear()
    backend.linear(x[:1], Weight(weight, bias=bias, packed=packed))
    backend.linear(x[:1].expand(too_many, 96), Weight(weight, bias=bias, packed=packed))
    assert kernel_calls.names() == ["linear_bf16"]  # one row: the GEMV; too many: F.linear


def test_model_products_use_the_packed_weights_between_two_and_max_rows(tiny_model_dir, kernel_calls):
    require_kernels(onednn=True)
    _, model = _model(tiny_model_dir, torch.bfloat16)
    backend = CpuKernelBackend()
    model.set_backend(backend)
    for rows in (1, 3, backend.max_packed_rows(model.prepared.head.packed) + 1):
        prompts = [min(512, rows - first) for first in range(0, rows, 512)]  # within the model's positions
        tables = [list(range(i * 129, i * 129 + n // 4 + 1)) for i, n in enumerate(prompts)]
        meta = AttentionMetadata.build(4, [], [(t, 0, n) for t, n in zip(tables, prompts)], True)
        positions = torch.cat([torch.arange(n) for n in prompts])
        model.compute_logits(model(torch.arange(rows) % 40 + 3, positions, meta,
                                   KVCache(model.cfg, 129 * len(prompts), 4, torch.bfloat16).layers))
    # every projection at 3 rows only (where the packed blocks run, the MLP's gate|up product is a fused call), and
    # the logits where the head's copy is in blocks (oneDNN's rounds to bf16, so its fp32 logits take the GEMV)
    projections = 4 - int(model.prepared.linears[model.layers[0].mlp.gate_up_proj].silu_fused is not None)
    head = int(model.prepared.head.packed.dim() == 4)
    rows_seen = [rows for name, rows in kernel_calls if name in ("tiled_linear_bf16", ONEDNN)]
    assert rows_seen == [3] * (projections * model.cfg.num_layers + head)
    model.set_backend(TorchBackend())
    prepared = model.prepared
    assert all(m in prepared.linears for m in model.modules() if isinstance(m, Linear))
    assert all(w.packed is None and w.silu_fused is None for w in prepared.linears.values())
    assert prepared.head.packed is None and prepared.stack is None


# ---- decode attention over fp8 pages ----------------------------------------------------------------------

def fp8_problem(batch, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """scattered_problem's contexts written through an fp8 KVCache (one layer). Returns q, the clean cache's
    (keys, values), the engine's metadata (tables padded with block 0), and a garbage copy of the pages for
    the kernel: every block outside the contexts random bytes (NaN codes and scales among them), every slot
    past a context NaN codes, every table entry past a context an invalid block id."""
    q, k, v, tables, lens = scattered_problem(batch, num_heads, num_kv_heads, head_dim, block_size, seed)
    cfg = ModelConfig(vocab_size=8, hidden_size=num_heads * head_dim, intermediate_size=8, num_layers=1,
                      num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    cache = KVCache(cfg, k.shape[0], block_size, torch.bfloat16, kv_format="fp8")
    rows = [(tables[b, : (int(n) + block_size - 1) // block_size].tolist(), int(n)) for b, n in enumerate(lens)]
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size for t, n in rows for p in range(n)])
    meta = AttentionMetadata.build(block_size, rows, [], use_kernels=True)
    plan = PageWrites.build(slots, block_size)
    blocks, offsets = slots // block_size, slots % block_size
    for pages, x in zip(cache.layers[0], (k, v)):
        pages.write(plan, x[blocks, offsets])
    gen = torch.Generator().manual_seed(seed)
    garbage = []
    for pages in cache.layers[0]:
        raw = torch.randint(0, 256, pages.raw.shape, dtype=torch.uint8, generator=gen)
        codes_bytes = block_size * num_kv_heads * head_dim
        written = raw[:, :codes_bytes].view(-1, block_size, num_kv_heads * head_dim)
        written[blocks, offsets] = pages.raw[:, :codes_bytes].view_as(written)[blocks, offsets]
        used = blocks.unique()
        raw[used, codes_bytes:] = pages.raw[used, codes_bytes:]  # the used pages' scales (and padding)
        stale = torch.ones(raw.shape[0], block_size, dtype=torch.bool)
        stale[blocks, offsets] = False
        written[used] = torch.where(stale[used, :, None], torch.tensor(0x7F, dtype=torch.uint8), written[used])
        garbage.append(raw)
    return q, cache.layers[0], meta, garbage, tables


def fp8_kernel(q, pages, meta, garbage, tables, scale):
    k_pages = pages[0]
    block_size, kv_heads, head_dim = k_pages.format.page_shape
    return cpu_ext.decode_attention_fp8(q, garbage[0], garbage[1], k_pages.format.fields[1].offset, block_size,
                                        kv_heads, head_dim, tables, meta.decode_context_lens, scale)


def gather_reference(q, pages, meta, scale):
    """What paged attention does without the kernel: gather + dequantise to bf16, then SDPA."""
    return attention._decode_attention(q, pages[0], pages[1], meta, scale)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (6, 2, 48)],
                         ids=["GQA-smollm2", "MHA", "GQA-tail-chunk"])
@pytest.mark.parametrize("batch", [1, 3, 33])
def test_fp8_decode_attention_matches_the_gather_path(num_heads, num_kv_heads, head_dim, batch):
    q, pages, meta, garbage, tables = fp8_problem(batch, num_heads, num_kv_heads, head_dim, seed=batch + 4)
    assert set(meta.decode_context_lens.tolist()) == ({300} if batch == 1 else {1, 15, 300} if batch == 3
                                                      else set(CONTEXT_LENS))
    got = fp8_kernel(q, pages, meta, garbage, tables, head_dim ** -0.5)
    ref = gather_reference(q, pages, meta, head_dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert not got.isnan().any()  # no garbage block, stale slot or table entry past a context was read
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=2e-3)


@pytest.mark.parametrize("threads", [1, 3])
def test_fp8_decode_attention_merges_rows_split_between_threads(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, pages, meta, garbage, tables = fp8_problem(1, 6, 2, 64, block_size=8, seed=5)  # one 300-token row
        got = fp8_kernel(q, pages, meta, garbage, tables, 0.125)
        torch.testing.assert_close(got.float(), gather_reference(q, pages, meta, 0.125).float(),
                                   rtol=2 ** -7, atol=2e-3)
    finally:
        torch.set_num_threads(previous)


def test_fp8_decode_attention_decodes_every_e4m3_code():
    """Rows with a single context token return their value row exactly: 16 rows of 16 codes cover all 256
    (subnormals, -0, NaN), each decoded as the gather path decodes it."""
    head_dim, block_size = 16, 16
    fmt = page_format("fp8", block_size, 1, head_dim)
    raw = torch.zeros(16, fmt.page_bytes, dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(16, 16)  # page i, slot 0: codes 16i..16i+15
    raw[:, :head_dim] = codes
    raw[:, fmt.fields[1].offset:fmt.fields[1].offset + 4] = torch.tensor([0.5]).view(torch.uint8)
    q = torch.zeros(16, 1, head_dim, dtype=torch.bfloat16)
    keys = raw.clone()
    keys[:, :head_dim] = 0
    out = cpu_ext.decode_attention_fp8(q, keys, raw, fmt.fields[1].offset, block_size, 1, head_dim,
                                       torch.arange(16)[:, None], torch.ones(16, dtype=torch.long), 1.0)
    expected = QuantizedPages(raw, fmt, torch.bfloat16).gather(torch.arange(16)[:, None])[:, 0, 0]  # [16, 1, D]
    nan = codes.view(16, 1, 16).bitwise_and(0x7F) == 0x7F
    assert torch.equal(out.isnan(), nan) and torch.equal(expected.isnan(), nan)
    assert torch.equal(out[~nan], expected[~nan])


def test_fp8_engine_uses_the_kernel_and_matches_enforce_eager(tiny_model_dir, kernel_calls):
    require_kernels(vectors=True)  # these paths run only where the kernels have AVX-512
    calls = kernel_calls.rows  # the rows of each fp8 attention call so far
    prompts = ["the cat sat on the mat", "hello there world", "one two three four five six seven"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype="fp8",
                  enforce_eager=eager)
        tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        assert bool(calls("decode_attention_fp8")) != eager  # the eager engine never called it; the fast one did
    assert tokens[False] == tokens[True]


def test_kernels_are_torch_operators_with_optional_tensors():
    """torch.ops.phase_serve.* carry schemas (what the dispatcher and torch.compile see); an absent bias or residual
    is None, not an empty tensor; the engine names come from the extension."""
    ops = cpu_ext.ops()
    assert "Tensor? bias" in str(ops.linear_bf16.default._schema)
    assert "Tensor? residual" in str(ops.rms_norm_bf16.default._schema)
    assert "Tensor(a!) x" in str(ops.rotary_bf16_.default._schema)
    x, w = bf16(3, 64), bf16(32, 64)
    assert torch.equal(ops.linear_bf16(x, w, None), cpu_ext.linear_bf16(x, w))
    normed, total = ops.rms_norm_bf16(x, None, bf16(64), 1e-5)
    assert total.data_ptr() == x.data_ptr() and normed.shape == x.shape
    assert cpu_ext.engine_names()[0] == "auto" and set(cpu_ext.matrix_engines()) <= set(cpu_ext.engine_names()[1:])
