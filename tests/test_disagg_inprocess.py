"""Disaggregated prefill without processes: a PrefillEngine computes straight into a decode engine's pages."""
from __future__ import annotations

import time

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineRequest
from engine.output_processor import OutputProcessor
from engine.prefill_engine import PrefillEngine, PrefillJob
from tests.test_engine import GREEDY, make_prompts

OPTIONS = dict(dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=32)


@pytest.fixture()
def pair(tiny_model_dir):
    decode = LLM(str(tiny_model_dir), **OPTIONS)
    prefill = PrefillEngine(EngineConfig(model=str(tiny_model_dir), **OPTIONS), source=decode.engine.source)
    prefill.attach_pool("decode-0", decode.engine.kv_cache)
    return decode, prefill


def run_disaggregated(decode: LLM, prefill: PrefillEngine, prompts: list[list[int]], params: SamplingParams):
    """Reserve on the decode side, prefill into those blocks, hand the first token over, decode to the end."""
    engine = decode.engine
    processor = OutputProcessor(decode.tokenizer)
    computed = {}
    for i, prompt in enumerate(prompts):
        rid = f"d{i}"
        processor.add(rid, None, prompt, params)
        blocks, cached = engine.reserve_remote_prefill(rid, prompt, time.monotonic() + 30)
        prefill.add(PrefillJob(rid, prompt, params, blocks, cached, "decode-0", time.monotonic() + 30))
    finals = {}
    while prefill.has_work():
        for res in prefill.step():
            computed[res.request_id] = len(prompts[int(res.request_id[1:])]) - res.num_cached_tokens
            req = EngineRequest(res.request_id, prompts[int(res.request_id[1:])], params)
            updates = engine.add_prefilled_request(req, res.first_token, res.logprobs, res.generator_state,
                                                     res.checksum)
            outs, _ = processor.process(updates)
            finals.update((o.request_id, o) for o in outs if o.finished)
    while engine.has_unfinished_requests():
        outs, _ = processor.process(engine.step())
        finals.update((o.request_id, o) for o in outs if o.finished)
    return [finals[f"d{i}"] for i in range(len(prompts))], computed


def test_disaggregated_greedy_equals_colocated(pair, tiny_model_dir):
    decode, prefill = pair
    prompts = make_prompts(8, seed=31)
    colocated = LLM(str(tiny_model_dir), **OPTIONS).generate(prompts, GREEDY)
    outs, _ = run_disaggregated(decode, prefill, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
    decode.engine.pool.check_integrity()
    assert decode.engine.pool.num_used == 0


def test_seeded_sampling_continues_across_the_hand_off(pair, tiny_model_dir):
    decode, prefill = pair
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    prompts = make_prompts(3, seed=32)
    colocated = LLM(str(tiny_model_dir), **OPTIONS).generate(prompts, params)
    outs, _ = run_disaggregated(decode, prefill, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]


def test_cached_prefix_on_the_decode_side_is_not_recomputed(pair):
    decode, prefill = pair
    shared = make_prompts(1, seed=33)[0] * 2
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    _, cold = run_disaggregated(decode, prefill, [first], GREEDY)
    warm_outs, warm = run_disaggregated(decode, prefill, [second], GREEDY)
    assert cold["d0"] == len(first)
    assert warm["d0"] == len(second) - len(shared) // 8 * 8  # only the uncached tail ran on the prefill side
    assert warm_outs[0].num_cached_tokens == len(shared) // 8 * 8
    decode.engine.pool.check_integrity()


def test_expired_reservation_releases_its_blocks(pair):
    decode, _ = pair
    engine = decode.engine
    shared = make_prompts(1, seed=34)[0]
    decode.generate([shared], GREEDY)  # leaves cached blocks behind
    blocks, cached = engine.reserve_remote_prefill("late", shared + [1, 2, 3], deadline=time.monotonic() - 1)
    assert cached > 0 and engine.pool.num_used == len(blocks)
    assert engine.expire_remote_prefills(time.monotonic()) == ["late"]
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0


def test_corrupted_hand_off_is_refused_and_released(pair):
    decode, prefill = pair
    engine = decode.engine
    prompt = make_prompts(1, seed=35)[0]
    blocks, cached = engine.reserve_remote_prefill("bad", prompt, time.monotonic() + 30)
    prefill.add(PrefillJob("bad", prompt, GREEDY, blocks, cached, "decode-0", time.monotonic() + 30))
    (res,) = prefill.step() or prefill.step() or prefill.step()
    engine.kv_cache.data[0, 0, blocks[-1], 0, 0, 0] += 1.0  # one value flipped after the prefill wrote it
    with pytest.raises(ValueError, match="checksum"):
        engine.add_prefilled_request(EngineRequest("bad", prompt, GREEDY), res.first_token, None,
                                     res.generator_state, res.checksum)
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
