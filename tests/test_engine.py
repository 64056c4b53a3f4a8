"""The batched engine against one-at-a-time generation, under chunking, preemption and prefix caching."""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import RequestError
from client.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_prompts(count: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def tiny_llm(model_dir, **options) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, **options}
    return LLM(str(model_dir), **options)


def assert_pool_clean(llm: LLM) -> None:
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy outputs generated one prompt at a time, chunking off, prefix cache off."""
    llm = tiny_llm(tiny_model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    return [llm.generate([p], GREEDY)[0].token_ids for p in make_prompts(16)]


@pytest.mark.parametrize("options", [
    dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=40),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=7, max_num_seqs=5),
], ids=["whole-prefill", "chunked-40", "chunked-7-max5"])
def test_batched_greedy_equals_one_at_a_time(tiny_model_dir, reference, options):
    llm = tiny_llm(tiny_model_dir, **options)
    outs = llm.generate(make_prompts(16), GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert_pool_clean(llm)


def test_preemption_resumes_exactly(tiny_model_dir, reference):
    # 16 sequences of up to ~84 tokens need far more than 24 blocks of 8 tokens.
    llm = tiny_llm(tiny_model_dir, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = llm.generate(make_prompts(16), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert_pool_clean(llm)


def test_prefix_cache_hits_give_identical_outputs(tiny_model_dir):
    shared = make_prompts(1, seed=5)[0] * 2  # a long shared system prompt
    prompts = [shared + tail for tail in make_prompts(6, seed=6)]
    cold = tiny_llm(tiny_model_dir, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = tiny_llm(tiny_model_dir)
    llm.generate(prompts[:1], GREEDY)
    hits_before = llm.engine.pool.prefix.stats.prefix_hits
    warm = llm.generate(prompts, GREEDY)
    assert llm.engine.pool.prefix.stats.prefix_hits - hits_before >= 6 * (len(shared) // 8)
    assert warm[1].num_cached_tokens >= len(shared) // 8 * 8
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert_pool_clean(llm)


def test_n_samples_with_seed_are_reproducible(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    prompt = make_prompts(1, seed=9)[0]
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1, "the 4 samples should differ"
    assert_pool_clean(llm)


def test_seeded_output_is_independent_of_batch(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    prompt = make_prompts(1, seed=11)[0]
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = make_prompts(7, seed=12)
    mixed = llm.generate([*others[:3], prompt, *others[3:]],
                         [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)] * 3 + [seeded]
                         + [GREEDY] * 4)
    assert mixed[3].token_ids == alone


def test_stop_string_across_token_boundaries(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    prompt = make_prompts(1, seed=13)[0]
    full = llm.generate([prompt], GREEDY)[0]
    text = full.text
    assert len(text) > 12
    stop = text[5:11]  # spans several tokens of the tiny vocabulary
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop"
    assert_pool_clean(llm)


def test_max_tokens_min_tokens_and_logprobs(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    eos = llm.tokenizer.eos_token_ids[0]
    prompt = make_prompts(1, seed=14)[0]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=1.0, seed=1, logprobs=3,
                            stop_token_ids=[eos])
    out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) == 12 and eos not in out.token_ids
    assert len(out.logprobs) == 12
    assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in out.logprobs)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids


def test_eos_ends_a_sequence_unless_ignored(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    prompt = make_prompts(1, seed=15)[0]
    free = llm.generate([prompt], GREEDY)[0].token_ids
    stop_id = free[5]  # pretend the sixth greedy token is a stop token
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free[: free.index(stop_id) + 1]
    assert out.finish_reason == "stop"


def test_truncate_prompt_tokens_runs_the_last_k_tokens(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    prompt = [t for p in make_prompts(3, seed=16) for t in p]
    keep_8 = dataclasses.replace(GREEDY, truncate_prompt_tokens=8)
    truncated, direct = llm.generate([prompt, prompt[-8:]], [keep_8, GREEDY])
    assert len(prompt) > 8 and truncated.prompt_token_ids == prompt[-8:] == direct.prompt_token_ids
    assert truncated.token_ids == direct.token_ids
    past_the_context = prompt * (llm.engine.max_model_len // len(prompt) + 1)
    assert llm.generate([past_the_context], keep_8)[0].token_ids == direct.token_ids
    with pytest.raises(RequestError):  # -1 keeps the whole context, which leaves no room for output (as vLLM)
        llm.generate([past_the_context], dataclasses.replace(GREEDY, truncate_prompt_tokens=-1))


def test_llm_takes_larger_steps_than_the_server_unless_told(tiny_model_dir):
    assert tiny_llm(tiny_model_dir).config.max_num_batched_tokens == OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().max_num_batched_tokens < OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert tiny_llm(tiny_model_dir, max_num_batched_tokens=40).config.max_num_batched_tokens == 40
