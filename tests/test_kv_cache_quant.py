"""Quantised KV pools (--kv-cache-dtype fp8 / fp4): page round trips, sizing, hand-off, and accuracy."""
from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from engine.core.builder import build_engine_core, build_prefill_engine
from engine.kv.export import create_shared_pool, open_shared_pool
from engine import LLM, SamplingParams
from engine.backends.attention import AttentionMetadata
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kernels import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from engine.kv.cache import KVCache, bytes_per_block, choose_num_blocks
from engine.kv.formats import PageWrites
from tests.test_disagg_inprocess import run_disaggregated
from tests.test_engine import GREEDY, assert_pool_clean, make_prompts
from tests.test_kv_quant import ref_pow2_ceil

QUANTISED = ("fp8", "fp4")
ROUND_TRIP = {"fp8": lambda x: dequantize_fp8(*quantize_fp8(x), dtype=x.dtype),
              "fp4": lambda x: dequantize_fp4(*quantize_fp4(x), dtype=x.dtype)}
SMOLLM2_GEOMETRY = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                               num_heads=9, num_kv_heads=3, head_dim=64)
TINY_GEOMETRY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32)


@pytest.fixture(autouse=True)
def one_thread(request):
    """Tiny models gain nothing from a second OpenMP thread and lose a lot when the cores are shared; the
    SmolLM2 test keeps every thread."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_llm(model_dir, kv_cache_dtype: str = "auto", **options) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, **options}
    return LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, **options)


def agreement_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------- pages and sizing

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_format", QUANTISED)
def test_page_written_then_gathered_equals_kernel_round_trip(kv_format, dtype):
    kv = KVCache(TINY_GEOMETRY, 6, 8, dtype, kv_format=kv_format)
    k_pages, v_pages = kv.layers[1]
    gen = torch.Generator().manual_seed(3)
    page = (torch.randn(1, 8, 2, 32, generator=gen) * 3).to(dtype)  # [1, bs, H, D]
    page[0, 2, 1, 5] = 0.0
    page[0, 6, 0, :4] = 1e-30  # subnormal after scaling
    slots = torch.arange(4 * 8, 5 * 8)  # every slot of block 4
    plan = PageWrites.build(slots, 8)
    k_pages.write(plan, page[0])
    v_pages.write(plan, -page[0])
    expected = ROUND_TRIP[kv_format](page)
    got_k = k_pages.gather(torch.tensor([[4]]))[0]  # [1, bs, H, D]
    got_v = v_pages.gather(torch.tensor([[4]]))[0]
    assert got_k.dtype == dtype
    assert torch.equal(got_k.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), ROUND_TRIP[kv_format](-page).view(torch.uint8))
    untouched = KVCache(TINY_GEOMETRY, 6, 8, dtype, kv_format=kv_format).data
    assert torch.equal(kv.data[0], untouched[0]) and torch.equal(kv.data[1, :, :4], untouched[1, :, :4])


@pytest.mark.parametrize("kv_format", QUANTISED)
def test_stale_slots_of_a_reused_block_do_not_widen_its_scales(kv_format):
    kv = KVCache(TINY_GEOMETRY, 4, 8, torch.float32, kv_format=kv_format)
    pages = kv.layers[0][0]
    pages.write(PageWrites.build(torch.arange(16, 24), 8), torch.full((8, 2, 32), 1000.0))  # previous owner
    fresh = torch.randn(1, 8, 2, 32, generator=torch.Generator().manual_seed(4))
    fresh[:, 3:] = 0.0  # a new sequence writes slots 0..2, in two steps as prefill + decode would
    pages.write(PageWrites.build(torch.arange(16, 18), 8), fresh[0, :2])
    pages.write(PageWrites.build(torch.tensor([18]), 8), fresh[0, 2:3])
    got = pages.gather(torch.tensor([[2]]))[0]
    assert torch.equal(got[:, 3:], torch.zeros_like(got[:, 3:]))
    scales = pages.fields(torch.tensor([2]))[-1][0]  # fp8: [H] one per kv-head; fp4: the page's
    amax = fresh[0].abs().amax(dim=(0, 2)) if kv_format == "fp8" else fresh.abs().max()
    expected = ref_pow2_ceil((amax / (448 if kv_format == "fp8" else 6 * 448)).numpy())
    assert torch.equal(scales, torch.from_numpy(expected).reshape(scales.shape))


@pytest.mark.parametrize("kv_format", QUANTISED)
def test_a_page_written_token_by_token_equals_one_written_whole(kv_format):
    """Scales are powers of two: when a later token grows a page's scale, the codes already there move by an
    exact power of two instead of being rounded a second time (values kept clear of E4M3's subnormals)."""
    gen = torch.Generator().manual_seed(5)
    magnitude = 0.5 + 3.5 * torch.rand(8, 2, 32, generator=gen)
    tokens = magnitude * torch.randn(8, 2, 32, generator=gen).sign() * torch.logspace(0, 1.5, 8)[:, None, None]
    whole = KVCache(TINY_GEOMETRY, 2, 8, torch.float32, kv_format=kv_format).layers[0][0]
    whole.write(PageWrites.build(torch.arange(8, 16), 8), tokens)
    one_by_one = KVCache(TINY_GEOMETRY, 2, 8, torch.float32, kv_format=kv_format).layers[0][0]
    for t in range(8):  # each token larger than the last: the scales grow at every write
        one_by_one.write(PageWrites.build(torch.tensor([8 + t]), 8), tokens[t:t + 1])
    assert torch.equal(one_by_one.raw[1], whole.raw[1])


def test_block_counts_at_a_fixed_budget_grow_by_the_page_size_ratio():
    budget = 64 << 20
    cfg, bs = SMOLLM2_GEOMETRY, 16
    counts = {f: choose_num_blocks(cfg, bs, torch.bfloat16, None, budget, 0, f) for f in ("auto", *QUANTISED)}
    per_block = {f: bytes_per_block(cfg, bs, torch.bfloat16, f) for f in counts}
    # bf16 page 16*3*64*2 = 6144 B; fp8 3072 codes + 3*4 scales = 3084 B; fp4 1536 + 192 + 4 = 1732 B
    assert per_block == {"auto": 60 * 6144, "fp8": 60 * 3084, "fp4": 60 * 1732}
    assert counts["auto"] < counts["fp8"] < counts["fp4"]
    assert all(counts[f] == budget // per_block[f] for f in counts)
    assert counts["fp8"] / counts["auto"] == pytest.approx(6144 / 3084, rel=0.01)
    assert counts["fp4"] / counts["auto"] == pytest.approx(6144 / 1732, rel=0.01)


def test_engine_sizes_its_pool_and_reports_bytes_per_token(tiny_model_dir):
    budget = 1 << 20
    stats = {f: tiny_llm(tiny_model_dir, f, num_kv_blocks=None, kv_cache_memory=budget).engine.stats()
             for f in ("auto", *QUANTISED)}
    # tiny model: 2 layers, 2 kv heads, head_dim 16, fp32, block 8
    assert {f: s.kv_bytes_per_token for f, s in stats.items()} == {"auto": 512.0, "fp8": 132.0, "fp4": 74.0}
    assert {f: s.kv_blocks_total for f, s in stats.items()} == {"auto": budget // 4096, "fp8": budget // 1056,
                                                               "fp4": budget // 592}


def test_invalid_kv_cache_dtypes_are_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCache(ModelConfig(64, 64, 64, 1, 4, 2, 24), 4, 8, torch.float32, kv_format="fp4")


# ----------------------------------------------------------------------------------- accuracy, tiny model

def teacher_forced_logits(model, token_ids: list[int], kv_format: str) -> torch.Tensor:
    """The prompt's first 8 tokens as one prefill, the rest one at a time as decodes: [T, V] logits."""
    kv = KVCache(model.cfg, len(token_ids) // 8 + 2, 8, torch.float32, kv_format=kv_format)
    table = list(range(len(token_ids) // 8 + 2))[::-1]
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata.build(8, [], [(table, 0, 8)])
        rows.append(model.compute_logits(model(torch.tensor(token_ids[:8]), torch.arange(8), meta, kv.layers)))
        for pos in range(8, len(token_ids)):
            meta = AttentionMetadata.build(8, [(table, pos + 1)], [])
            rows.append(model.compute_logits(model(torch.tensor([token_ids[pos]]), torch.tensor([pos]), meta,
                                                   kv.layers)))
    return torch.cat(rows)


def test_fp4_error_is_larger_than_fp8_and_bounded(tiny_model_dir):
    model = tiny_llm(tiny_model_dir, num_kv_blocks=4).engine.runner.model
    rng = random.Random(11)
    ids = [rng.randrange(3, 512) for _ in range(160)]
    ref = teacher_forced_logits(model, ids, "auto").log_softmax(-1)
    kl, top1 = {}, {}
    for kv_format in QUANTISED:
        logq = teacher_forced_logits(model, ids, kv_format).log_softmax(-1)
        kl[kv_format] = (ref.exp() * (ref - logq)).sum(-1)[8:]  # the first 8 rows never read the cache
        top1[kv_format] = (ref.argmax(-1) == logq.argmax(-1)).float()[8:].mean().item()
    print(f"\ntiny model, 152 decode positions: KL mean fp8 {kl['fp8'].mean():.2e} fp4 {kl['fp4'].mean():.2e}; "
          f"top-1 agreement fp8 {top1['fp8']:.3f} fp4 {top1['fp4']:.3f}")
    # measured (1 thread): KL mean fp8 1.9e-3, fp4 2.0e-2; top-1 fp8 0.89, fp4 0.78 (this random model's
    # top-2 margins are tiny: median 0.19 logits, so top-1 flips easily)
    assert kl["fp8"].mean() < 5e-3 and kl["fp8"].max() < 0.03
    assert 3 * kl["fp8"].mean() < kl["fp4"].mean() < 0.05 and kl["fp4"].max() < 0.2
    assert top1["fp8"] >= 0.8 and top1["fp4"] >= 0.6


GREEDY_PROMPTS = 48  # the tiny model's greedy choices are near ties (median top-2 margin 0.19 logits): with 16
# prompts, how many agree swung from 7 to 10 between two equally accurate encodings (teacher-forced KL 1.7e-3
# against 1.9e-3), so the rate is measured on more prompts and fp4 on the same prompts is the control.


@pytest.fixture(scope="module")
def greedy_agreement(tiny_model_dir) -> dict[str, list[int]]:
    """Agreement lengths of greedy outputs with fp8 and fp4 pools against the fp32 pool."""
    prompts = make_prompts(GREEDY_PROMPTS)
    ref = [o.token_ids for o in tiny_llm(tiny_model_dir, num_kv_blocks=1024).generate(prompts, GREEDY)]
    lengths = {}
    for kv_format in QUANTISED:
        llm = tiny_llm(tiny_model_dir, kv_format, num_kv_blocks=1024)
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert_pool_clean(llm)
        lengths[kv_format] = [agreement_length(a, b) for a, b in zip(ref, outs)]
    return lengths


def test_fp8_greedy_mostly_agrees_with_full_precision(greedy_agreement):
    first8 = {f: sum(n >= 8 for n in lengths) for f, lengths in greedy_agreement.items()}
    print(f"\nquantised vs fp32 KV, tiny model: first 8 tokens identical on fp8 {first8['fp8']}/{GREEDY_PROMPTS}, "
          f"fp4 {first8['fp4']}/{GREEDY_PROMPTS}")
    # measured: fp8 23/48, fp4 10/48 (on 64 prompts of two other seeds, fp8 32 and 38 of 64)
    assert first8["fp8"] >= 0.4 * GREEDY_PROMPTS
    assert sum(greedy_agreement["fp8"]) >= 0.4 * GREEDY_PROMPTS * 24
    assert sum(greedy_agreement["fp8"]) > sum(greedy_agreement["fp4"])


def test_fp4_runs_end_to_end_under_chunking_and_preemption(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, "fp4", num_kv_blocks=24, max_num_batched_tokens=40)
    outs = llm.generate(make_prompts(16), GREEDY)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_clean(llm)


# ----------------------------------------------------------------------------------- hand-off between actors

# A budget that prefills every prompt in one chunk on both sides: a quantised page's bytes depend on how it
# was filled (re-quantised per write), and with a small budget the colocated scheduler cuts chunks elsewhere
# than the prefill engine does (decodes share its budget), so outputs could then differ by rounding.
OPTIONS = dict(dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=512)


def exported_pair(tiny_model_dir, kv_format: str):
    """A decode engine whose pool lives in shared memory and a prefill engine that mapped it from the
    export alone, as a prefill actor does (two mappings of one file)."""
    pools = []

    def allocate(shape, dtype):
        pools.append(create_shared_pool(shape, dtype, tag="test-quant"))
        return pools[0].tensor

    config = EngineConfig(model=str(tiny_model_dir), kv_cache_dtype=kv_format, **OPTIONS)
    engine = build_engine_core(config, kv_allocator=allocate)
    decode = SimpleNamespace(engine=engine, tokenizer=engine.source.tokenizer)  # what run_disaggregated uses
    kv = engine.kv_cache
    export = dict(pools[0].export, bytes_per_token=kv.bytes_per_token, kv_format=kv.kv_format)
    prefill = build_prefill_engine(config, source=decode.engine.source)
    mapped = KVCache.from_export(decode.engine.source.config, kv.num_blocks, kv.block_size,
                                 open_shared_pool(export), export, prefill.dtype)
    prefill.attach_pool("decode-0", mapped)
    return decode, prefill, pools[0]


@pytest.mark.parametrize("kv_format", QUANTISED)
def test_disaggregated_into_a_quantised_pool_equals_colocated(tiny_model_dir, kv_format):
    decode, prefill, pool = exported_pair(tiny_model_dir, kv_format)
    try:
        assert decode.engine.kv_cache.data.dtype == torch.uint8
        assert prefill.pools["decode-0"].kv_format == kv_format
        prompts = make_prompts(8, seed=31)
        colocated = tiny_llm(tiny_model_dir, kv_format, **OPTIONS).generate(prompts, GREEDY)
        outs, _ = run_disaggregated(decode, prefill, prompts, GREEDY)  # checksums verified on admission
        assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
        assert_pool_clean(decode)
    finally:
        pool.close()


@pytest.mark.parametrize("kv_format", QUANTISED)
def test_corrupted_quantised_hand_off_is_refused(tiny_model_dir, kv_format):
    from engine.core.engine_core import EngineRequest
    from engine.core.prefill_engine import PrefillJob

    decode, prefill, pool = exported_pair(tiny_model_dir, kv_format)
    try:
        engine = decode.engine
        prompt = make_prompts(1, seed=35)[0]
        blocks, cached = engine.reserve_remote_prefill("bad", prompt, time.monotonic() + 30)
        prefill.add(PrefillJob("bad", prompt, GREEDY, blocks, cached, "decode-0", time.monotonic() + 30))
        (res,) = prefill.step()
        scale_byte = engine.kv_cache.page_format.fields[-1].offset
        engine.kv_cache.data[-1, 1, blocks[0], scale_byte] ^= 1  # one scale bit flipped after the write
        with pytest.raises(ValueError, match="checksum"):
            engine.add_prefilled_request(EngineRequest("bad", prompt, GREEDY), res.first_token, None,
                                         res.checksum)
        assert_pool_clean(decode)
    finally:
        pool.close()


@pytest.mark.process
async def test_prefill_actor_writes_a_quantised_decode_actor_pool(tiny_model_dir):
    """Real actor processes: the prefill actor maps the decode actor's fp8 pool from its export alone."""
    from engine import AsyncLLM

    prompts = make_prompts(6, seed=51)
    colocated = [o.token_ids for o in tiny_llm(tiny_model_dir, "fp8", **OPTIONS).generate(prompts, GREEDY)]
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always", kv_cache_dtype="fp8",
                   **OPTIONS)
    await llm.start()
    try:
        outs = []
        for prompt in prompts:  # the budget (512) prefills each prompt in one chunk, here and colocated
            async for out in llm.generate(prompt, GREEDY):
                token_ids = out.token_ids
            outs.append(token_ids)
        router = llm._client
        decode = router.supervisor.ready("decode")[0].ready
        assert decode.kv_export["kv_format"] == "fp8" and decode.kv_export["dtype"] == "uint8"
        # every prompt was handed over (and its checksum verified)
        assert router.handoff.counters.kv_transfers >= len(prompts)
        assert outs == colocated
        assert llm.stats().kv_bytes_per_token == 132.0
    finally:
        await llm.aclose()


# ----------------------------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def smollm2_fp8_agreement() -> list[int]:
    """Greedy agreement lengths of SmolLM2 with an fp8 pool against bf16, on the bench's 16 chat prompts."""
    from bench.kv_accuracy import CHAT_PROMPTS

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    ref = [o.token_ids for o in LLM(num_kv_blocks=256).chat(messages, params)]
    llm = LLM(num_kv_blocks=256, kv_cache_dtype="fp8")
    outs = [o.token_ids for o in llm.chat(messages, params)]
    assert_pool_clean(llm)
    lengths = [agreement_length(a, b) for a, b in zip(ref, outs)]
    print(f"\nSmolLM2 fp8 vs bf16 KV: first 16 tokens identical on {sum(n >= 16 for n in lengths)}/{len(lengths)} "
          f"chat prompts; agreement lengths {lengths}")
    return lengths


@pytest.mark.slow
@pytest.mark.timeout(900)  # two SmolLM2 engines plus cold Numba compilation of the page kernels
def test_smollm2_fp8_greedy_identical_for_16_tokens_on_most_prompts(smollm2_fp8_agreement):
    # measured on the bench's 16 chat prompts: 11/16, lengths [19, 24, 24, 24, 24, 24, 13, 24, 11, 5, 9, 14, 18,
    # 18, 24, 24], 78% of all tokens (scales as amax / 448 before they became powers of two: 9/16, 65%).
    assert sum(n >= 16 for n in smollm2_fp8_agreement) > len(smollm2_fp8_agreement) / 2
    assert sum(smollm2_fp8_agreement) >= 0.65 * len(smollm2_fp8_agreement) * 24
