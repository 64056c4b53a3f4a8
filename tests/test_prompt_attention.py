"""The prompt-attention kernel (engine/kernels/prompt_attention.cpp) on each engine this CPU has (AMX tiles,
AVX-512 BF16 vectors), and where paged attention uses it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.backends.attention import AttentionMetadata
from engine.backends import CpuKernelBackend, TorchBackend
from engine.kernels import cpu_ext
from engine.kv.cache import KVCache
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.kernel_helpers import kernel_calls, require_kernels  # noqa: F401 (fixture)
from tests.tiny_models import tiny_llama_config, write_tiny_model


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels(matrix_engine=True)


@pytest.fixture(params=["tiles", "vectors"])
def engine(request) -> str:
    """A matrix engine, skipped where this CPU does not have it."""
    if request.param not in cpu_ext.matrix_engines():
        pytest.skip(f"no {request.param} engine on this CPU")
    return request.param


def fused_views(count: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q, k, v as the model passes them: strided views of one fused qkv output [count * length, ...]."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(count * length, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
              context: int = 0) -> torch.Tensor:
    """Causal attention in float64 of each chunk of S queries to its `context` + S keys: query i sees keys up to
    context + i."""
    rows, heads, head_dim = q.shape
    length, group = rows // count, heads // k.shape[1]
    qh = q.double().reshape(count, length, -1, head_dim).transpose(1, 2)
    kh, vh = (x.double().reshape(count, context + length, -1, head_dim).transpose(1, 2) for x in (k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    hidden = torch.ones(length, context + length).triu(context + 1).bool()
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(hidden, -torch.inf)
    return (scores.softmax(-1) @ vh).transpose(1, 2).reshape(rows, heads, head_dim)


def within_bf16_noise(out: torch.Tensor, exact: torch.Tensor, v: torch.Tensor) -> bool:
    """Probabilities rounded to bf16 for the product with V (as torch's flash attention does), fp32 sums, one
    rounding of the output: within about one bf16 ulp of the output plus one of the values' scale."""
    bound = exact.abs() * 2 ** -7 + v.abs().max().double() * 2 ** -9
    return bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("count,length", [(1, 1), (2, 5), (3, 17), (16, 128), (1, 300), (4, 33)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (6, 1, 64), (4, 2, 128)],
                         ids=["GQA-smollm2", "MHA-32", "MQA", "GQA-128"])
def test_prompt_attention_matches_a_float64_reference(count, length, heads, kv_heads, head_dim, engine):
    q, k, v = fused_views(count, length, heads, kv_heads, head_dim, seed=count * length)
    scale = head_dim ** -0.5
    assert CpuKernelBackend().takes_prompts(q, k, v, count)
    out = cpu_ext.prompt_attention(q, k, v, count, scale, engine)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert within_bf16_noise(out, reference(q, k, v, count, scale), v)


def chunk_after_context(context: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q of the prompt's last `length` tokens and k, v of all its context + length tokens, as the paged path
    passes them: the queries a strided view of the fused qkv, the keys and values whole rows gathered from pages."""
    q, k, v = fused_views(1, context + length, heads, kv_heads, head_dim, seed)
    return q[context:], k.contiguous(), v.contiguous()


@pytest.mark.parametrize("context,length", [(1, 1), (5, 17), (31, 33), (32, 32), (100, 7), (300, 64), (7, 300),
                                            (1000, 512)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 1, 64), (4, 2, 128)],
                         ids=["GQA-smollm2", "MQA", "GQA-128"])
def test_a_chunk_after_its_context_matches_a_float64_reference(context, length, heads, kv_heads, head_dim, engine):
    q, k, v = chunk_after_context(context, length, heads, kv_heads, head_dim, seed=context + length)
    scale = head_dim ** -0.5
    out = cpu_ext.prompt_attention(q, k, v, 1, scale, engine, context)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert within_bf16_noise(out, reference(q, k, v, 1, scale, context), v)


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int, num_blocks: int, seed: int = 0):
    """k, v [T, Hkv, D] written into pages [num_blocks, block_size, Hkv, D] at shuffled blocks (garbage elsewhere)
    -> (k pages, v pages, the int64 block table that names them in order)."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-len(k) // block_size)
    table = torch.randperm(num_blocks, generator=gen)[:used]
    pages = []
    for x in (k, v):
        page = (torch.randn(num_blocks, block_size, *x.shape[1:], generator=gen) * 50).to(torch.bfloat16)
        padded = page[table].reshape(used * block_size, *x.shape[1:]).clone()  # garbage past the last key too
        padded[: len(x)] = x
        page[table] = padded.view(used, block_size, *x.shape[1:])
        pages.append(page)
    return pages[0], pages[1], table


@pytest.mark.parametrize("context,length,block_size", [(1, 1, 16), (5, 17, 16), (31, 33, 32), (100, 7, 16),
                                                       (600, 41, 16), (7, 300, 64), (1000, 512, 16)])
def test_keys_read_in_place_from_the_pages_give_the_bits_of_gathered_keys(context, length, block_size, engine):
    q, k, v = chunk_after_context(context, length, 9, 3, 64, seed=context + length)
    k_pages, v_pages, table = paged(k, v, block_size, num_blocks=-(-(context + length) // block_size) + 9)
    gathered = cpu_ext.prompt_attention(q, k, v, 1, 0.125, engine, context)
    in_place = cpu_ext.prompt_attention(q, k_pages, v_pages, 1, 0.125, engine, context, table)
    assert torch.equal(in_place, gathered)


def test_paged_keys_refuse_a_table_that_does_not_fit_the_pages(engine):
    q, k, v = chunk_after_context(40, 8, 4, 2, 64)
    k_pages, v_pages, table = paged(k, v, 16, num_blocks=6)
    with pytest.raises(RuntimeError, match="cover the context"):
        cpu_ext.prompt_attention(q, k_pages, v_pages, 1, 0.1, engine, 40, table[:2])
    with pytest.raises(RuntimeError, match="outside the pages"):
        cpu_ext.prompt_attention(q, k_pages, v_pages, 1, 0.1, engine, 40, table + 6)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ext.prompt_attention(q, k_pages.view(12, 8, 2, 64), v_pages.view(12, 8, 2, 64), 1, 0.1, engine, 40,
                                 torch.arange(7))
    with pytest.raises(RuntimeError, match="one chunk"):
        cpu_ext.prompt_attention(torch.cat([q, q]), k_pages, v_pages, 2, 0.1, engine, 40, table)


def test_the_backend_reads_plain_bf16_pages_in_place_and_declines_the_rest():
    backend = CpuKernelBackend()
    q, k, v = chunk_after_context(40, 8, 4, 2, 64)
    k_pages, v_pages, table = paged(k, v, 16, num_blocks=6)
    out = backend.paged_extend_attention(q, k_pages, v_pages, table, 40, 0.1)
    assert out is not None and torch.equal(out, backend.extend_attention(q, k, v, 40, 0.1))
    assert backend.paged_extend_attention(q, k_pages, v_pages, table, 40, 0.1, window=16) is None
    assert backend.paged_extend_attention(q, k_pages, v_pages, table, 40, 0.1, softcap=30.0) is None
    assert backend.paged_extend_attention(q, k_pages.float(), v_pages.float(), table, 40, 0.1) is None
    small_k, small_v = k_pages.view(12, 8, 2, 64), v_pages.view(12, 8, 2, 64)  # 8-token blocks span a tile
    assert backend.paged_extend_attention(q, small_k, small_v, torch.arange(7), 40, 0.1) is None


@pytest.mark.parametrize("context", [1, 31, 32, 45, 160])
def test_a_chunk_gives_the_bits_of_the_same_rows_of_the_whole_prompt(context, engine):
    """Chunked prefill changes no bit: the rows of a chunk after its context equal those rows of the whole
    prompt computed at once (each query's scores, softmax and value sums run over the same keys in one order)."""
    length = 70
    q, k, v = fused_views(1, context + length, 9, 3, 64, seed=context)
    whole = cpu_ext.prompt_attention(q, k, v, 1, 0.125, engine)
    chunk = cpu_ext.prompt_attention(q[context:], k.contiguous(), v.contiguous(), 1, 0.125, engine, context)
    assert torch.equal(chunk, whole[context:])


def test_a_chunk_sees_its_context_and_nothing_past_each_query(engine):
    """A key of the context changes every query of the chunk; a key of the chunk changes only the queries at and
    after it."""
    context, length = 50, 40
    q, k, v = chunk_after_context(context, length, 9, 3, 64, seed=9)
    before = cpu_ext.prompt_attention(q, k, v, 1, 0.125, engine, context)
    for key, first_changed in ((10, 0), (context + 25, 25)):
        k2, v2 = k.clone(), v.clone()
        k2[key], v2[key] = 5.0, -5.0
        after = cpu_ext.prompt_attention(q, k2, v2, 1, 0.125, engine, context)
        assert torch.equal(after[:first_changed], before[:first_changed])
        assert (after[first_changed:] != before[first_changed:]).any(dim=(1, 2)).all()


def test_a_query_sees_only_its_own_prompt_up_to_itself(engine):
    """Changing prompt 1's key and value at token 40 leaves every query before it and every other prompt
    bit-identical, and changes the queries from token 40 on. A NaN there reaches no other prompt (within the
    prompt, queries 32-39 share a block product with token 40: zero probability times NaN, as in SDPA)."""
    count, length = 3, 70
    q, k, v = fused_views(count, length, 9, 3, 64, seed=7)
    before = cpu_ext.prompt_attention(q, k, v, count, 0.125, engine)
    row = length + 40
    for value in (3.0, -50.0, float("nan")):
        k2, v2 = k.clone(), v.clone()
        k2[row], v2[row] = value, -value
        after = cpu_ext.prompt_attention(q, k2, v2, count, 0.125, engine)
        untouched = torch.ones(count * length, dtype=torch.bool)
        untouched[(length + 32 if value != value else row):2 * length] = False
        assert torch.equal(after[untouched], before[untouched])
        assert (after[row:2 * length] != before[row:2 * length]).any(dim=(1, 2)).all()


def test_prompt_attention_equals_one_prompt_at_a_time(engine):
    count, length = 5, 45
    q, k, v = fused_views(count, length, 9, 3, 64, seed=3)
    together = cpu_ext.prompt_attention(q, k, v, count, 0.125, engine)
    for p in range(count):
        rows = slice(p * length, (p + 1) * length)
        assert torch.equal(cpu_ext.prompt_attention(q[rows], k[rows], v[rows], 1, 0.125, engine), together[rows])


def test_prompt_attention_gives_the_same_bits_on_any_thread_count(engine):
    q, k, v = fused_views(8, 64, 9, 3, 64, seed=5)
    previous = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(cpu_ext.prompt_attention(q, k, v, 8, 0.125, engine))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


def test_auto_takes_the_first_engine_and_an_engine_not_here_is_refused():
    engines = cpu_ext.matrix_engines()
    q, k, v = fused_views(4, 40, 9, 3, 64, seed=11)
    assert torch.equal(cpu_ext.prompt_attention(q, k, v, 4, 0.125),
                       cpu_ext.prompt_attention(q, k, v, 4, 0.125, engines[0]))
    with pytest.raises(ValueError, match="engine must be one of"):
        cpu_ext.prompt_attention(q, k, v, 4, 0.125, "amx")
    for missing in {"tiles", "vectors"} - set(engines):
        with pytest.raises(RuntimeError, match="no (AMX tiles|AVX-512 BF16) in this build"):
            cpu_ext.prompt_attention(q, k, v, 4, 0.125, missing)


def test_tiles_and_vectors_agree_within_one_rounding():
    if len(cpu_ext.matrix_engines()) < 2:
        pytest.skip("one engine on this CPU: nothing to compare")
    q, k, v = fused_views(6, 77, 9, 3, 64, seed=13)
    tiles = cpu_ext.prompt_attention(q, k, v, 6, 0.125, "tiles").float()
    vectors = cpu_ext.prompt_attention(q, k, v, 6, 0.125, "vectors").float()
    assert ((tiles - vectors).abs() <= tiles.abs() * 2 ** -7 + v.abs().max().float() * 2 ** -8).all()


def test_prompt_attention_takes_only_what_it_can_and_rejects_the_rest(engine):
    backend = CpuKernelBackend()
    q, k, v = fused_views(2, 8, 4, 2, 48)  # head_dim 48: not whole tiles
    assert not backend.takes_prompts(q, k, v, 2)
    with pytest.raises(RuntimeError, match="head_dim 48"):
        cpu_ext.prompt_attention(q, k, v, 2, 0.1, engine)
    q, k, v = fused_views(3, 8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="count x S"):
        cpu_ext.prompt_attention(q, k, v, 5, 0.1, engine)  # 24 rows are not 5 prompts
    assert not backend.takes_prompts(q.float(), k.float(), v.float(), 3)
    long_q, long_k, long_v = fused_views(1, backend.config.max_prompt_attention_tokens + 1, 1, 1, 32)
    assert not backend.takes_prompts(long_q, long_k, long_v, 1)
    with pytest.raises(RuntimeError, match="keys of a chunk"):
        cpu_ext.prompt_attention(long_q, long_k, long_v, 1, 0.1, engine)
    context = backend.config.max_prompt_attention_tokens - 7
    assert backend.extend_attention(long_q[:8], long_k[:context + 8], long_v[:context + 8], context, 0.1) is None
    with pytest.raises(RuntimeError, match="keys of a chunk"):
        cpu_ext.prompt_attention(long_q[:8], long_k[:context + 8], long_v[:context + 8], 1, 0.1, engine, context)
    with pytest.raises(RuntimeError, match="k must be"):  # keys for a context of 4 where 5 are passed
        cpu_ext.prompt_attention(q[:8], k[:12], v[:12], 1, 0.1, engine, 5)
    short_q, short_k, short_v = chunk_after_context(20, 8, 4, 2, 64)
    assert backend.extend_attention(short_q, short_k, short_v, 20, 0.1, window=16) is None
    assert backend.extend_attention(short_q, short_k, short_v, 20, 0.1, softcap=30.0) is None
    assert backend.extend_attention(short_q, short_k, short_v, 20, 0.1) is not None


@pytest.fixture(scope="module")
def head_dim_32_dir(tmp_path_factory):
    """A tiny model whose heads the kernel takes (head_dim 32; the shared tiny model's is 16)."""
    config = tiny_llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    return write_tiny_model(tmp_path_factory.mktemp("head_dim_32"), config)


@pytest.mark.parametrize("block", [4, 16])
def test_bf16_prefill_uses_the_kernel_and_stays_within_bf16_noise(head_dim_32_dir, kernel_calls, block):
    """A step with three fresh prompts of one length (one run), a longer fresh prompt and a chunk after cached
    context: the kernel serves the two fresh runs, the chunk after its context (its keys read in place from
    pages of 16 tokens, gathered from pages of 4), and the forward that cached the context; logits stay within
    bf16 noise of the model with the kernels off, on the same pages."""
    cfg = read_hf_config(head_dim_32_dir)
    same = [[(7 * i + j) % 500 + 3 for j in range(11)] for i in range(3)]
    longer = list(range(20, 57))
    cached, chunk = list(range(100, 112)), list(range(200, 209))
    logits = {}
    for name, kernels_on in (("eager", False), ("fast", True)):
        model = build_model(cfg, iter_hf_weights(head_dim_32_dir), torch.bfloat16)
        model.set_backend(CpuKernelBackend() if kernels_on else TorchBackend())
        kv = KVCache(cfg, 64, block, torch.bfloat16)
        tables = [list(range(10 * i, 10 * i + 10)) for i in range(5)]
        warm = AttentionMetadata.build(block, [], [(tables[4], 0, len(cached))], kernels_on)
        model(torch.tensor(cached), torch.arange(len(cached)), warm, kv.layers)  # the chunk's cached context
        segments = [(tables[i], 0, 11) for i in range(3)] + [(tables[3], 0, len(longer)),
                                                             (tables[4], len(cached), len(chunk))]
        meta = AttentionMetadata.build(block, [], segments, kernels_on)
        ids = [t for p in same for t in p] + longer + chunk
        positions = [j for _ in same for j in range(11)] + list(range(len(longer))) + \
            list(range(len(cached), len(cached) + len(chunk)))
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta, kv.layers)
        logits[name] = model.compute_logits(hidden)
    assert kernel_calls.prompt_counts == ([(len(cached), 1, 0)] * cfg.num_layers
                                          + [(33, 3, 0), (len(longer), 1, 0), (len(chunk), 1, len(cached))]
                                          * cfg.num_layers)
    assert kernel_calls.paged_prompts == (cfg.num_layers if block == 16 else 0)
    ref = logits["eager"]
    assert (logits["fast"] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (logits["fast"].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
