"""The compiled CPU kernels (engine/kernels/cpu_ext.*) against torch references, alone and inside the model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kernels import cpu_ext
from engine.kv_cache import KVCache
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model


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


def test_linear_applies_only_to_few_row_bf16_products():
    w = bf16(8, 16)
    assert cpu_ext.applies(bf16(1, 16), w)
    assert not cpu_ext.applies(bf16(cpu_ext.MAX_GEMV_ROWS + 1, 16), w)
    assert not cpu_ext.applies(torch.randn(1, 16), w.float())
    assert not cpu_ext.applies(bf16(1, 16), bf16(16, 8).t())  # not contiguous


def reference_decode_attention(q, k_pages, v_pages, tables, lens, scale):
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        keys = k_pages[tables[b]].flatten(0, 1)[:n].float().transpose(0, 1)[None]  # [1, Hkv, n, D]
        values = v_pages[tables[b]].flatten(0, 1)[:n].float().transpose(0, 1)[None]
        query = q[b].float()[None, :, None, :]  # [1, Hq, 1, D]
        out.append(F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_decode_attention_reads_pages_in_place(num_heads, num_kv_heads):
    torch.manual_seed(num_heads)
    num_blocks, block_size, head_dim = 40, 8, 32
    k_pages, v_pages = bf16(num_blocks, block_size, num_kv_heads, head_dim), bf16(num_blocks, block_size,
                                                                                   num_kv_heads, head_dim)
    lens = torch.tensor([1, 8, 9, 31, 70])  # one token, a full block, one past it, ...
    tables = torch.stack([torch.randperm(num_blocks)[:10] for _ in lens])  # scattered blocks; tails never read
    q = bf16(len(lens), num_heads, head_dim)
    got = cpu_ext.decode_attention_bf16(q, k_pages, v_pages, tables, lens, 0.2)
    ref = reference_decode_attention(q, k_pages, v_pages, tables, lens, 0.2)
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=2e-3)


def test_decode_attention_ignores_blocks_past_the_context():
    k_pages, v_pages = bf16(6, 4, 1, 16), bf16(6, 4, 1, 16)
    q = bf16(1, 2, 16)
    lens = torch.tensor([5])
    first = cpu_ext.decode_attention_bf16(q, k_pages, v_pages, torch.tensor([[3, 1, 0]]), lens, 0.25)
    k_pages[0], v_pages[0] = 1e4, -1e4  # block 0 is past the 5-token context
    k_pages[1, 1:], v_pages[1, 1:] = 1e4, -1e4  # slots 1.. of the second block too
    second = cpu_ext.decode_attention_bf16(q, k_pages, v_pages, torch.tensor([[3, 1, 0]]), lens, 0.25)
    assert torch.equal(first, second)


def _model(folder, dtype):
    cfg = read_hf_config(folder)
    return cfg, build_model(cfg, iter_hf_weights(folder), dtype)


def test_bf16_model_with_kernels_matches_torch_ops(tiny_model_dir, monkeypatch):
    """Prefill chunks, then decode steps: logits with the kernels on stay within bf16 noise of the eager
    model's on the same pages (and the kernels did run)."""
    calls = {"linear": 0, "attention": 0}

    def spy(name, func):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return func(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(cpu_ext, "linear_bf16", spy("linear", cpu_ext.linear_bf16))
    monkeypatch.setattr(cpu_ext, "decode_attention_bf16", spy("attention", cpu_ext.decode_attention_bf16))
    cfg, eager = _model(tiny_model_dir, torch.bfloat16)
    _, fast = _model(tiny_model_dir, torch.bfloat16)
    fast.use_kernels(True)
    block = 4
    prompts = [[5, 9, 33, 2, 7, 100, 3], [11, 12, 13], [400, 401, 402, 403, 404, 405, 406, 407, 408]]
    logits = {}
    for name, model, kernels in (("eager", eager, False), ("fast", fast, True)):
        kv = KVCache(cfg, 32, block, torch.bfloat16)
        tables = [list(range(10 * i + 9, 10 * i - 1, -1)) for i in range(len(prompts))]
        rows = []
        for table, ids in zip(tables, prompts):  # prefill each prompt
            meta = AttentionMetadata.build(block, [], [(table, 0, len(ids))], kernels)
            model(torch.tensor(ids), torch.arange(len(ids)), meta, kv.layers)
        for step in range(3):  # then decode: the first two together, the third alone
            for group in ([0, 1], [2]):
                positions = [len(prompts[i]) + step for i in group]
                meta = AttentionMetadata.build(block, [(tables[i], p + 1) for i, p in zip(group, positions)], [],
                                               kernels)
                hidden = model(torch.tensor([7 + step] * len(group)), torch.tensor(positions), meta, kv.layers)
                rows.append(model.compute_logits(hidden))
        logits[name] = torch.cat(rows)
    # Within the limits: every projection of the decode steps (two rows or one; 4 a layer + the head) and of
    # the 3-token prefill (not the 7- and 9-token ones); the attention kernel for the one-sequence steps.
    assert (cpu_ext.MAX_GEMV_ROWS, cpu_ext.MAX_ATTENTION_SEQS) == (5, 1)
    assert calls["linear"] == 6 * (4 * cfg.num_layers + 1) + 4 * cfg.num_layers
    assert calls["attention"] == 3 * cfg.num_layers
    ref = logits["eager"]
    assert (logits["fast"] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (logits["fast"].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


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
    on = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16))
    off = EngineCore(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=16,
                                  enforce_eager=True))
    assert on.runner.use_kernels and on.runner.model.kernels_on
    assert not off.runner.use_kernels and not off.runner.model.kernels_on


def test_verification_rows_through_the_kernel_match_the_causal_segment(tiny_model_dir, monkeypatch):
    """A sequence's last token + 3 drafts, verified as decode rows with growing context (what the runner does
    at batch 1 with the kernels on) gives the logits of the causal-segment path, within bf16 noise."""
    cfg, model = _model(tiny_model_dir, torch.bfloat16)
    model.use_kernels(True)
    block, prompt, drafts = 4, [5, 9, 33, 2, 7, 100, 3, 8, 41], [12, 13, 14, 15]
    table = [9, 3, 7, 1, 5]
    logits = {}
    calls = []
    monkeypatch.setattr(cpu_ext, "decode_attention_bf16",
                        lambda *a, f=cpu_ext.decode_attention_bf16: calls.append(a[0].shape[0]) or f(*a))
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
    assert calls == [4] * cfg.num_layers  # the rows version went through the kernel, all four rows at once
    ref = logits[False]
    assert (logits[True] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.equal(logits[True].argmax(-1), ref.argmax(-1))
