"""Disaggregated prefill without processes: a PrefillEngine computes straight into a decode engine's pages."""
from __future__ import annotations

import time

import pytest
import torch

from engine.core.builder import build_prefill_engine
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineRequest
from engine.core.output_processor import OutputProcessor
from engine.core.prefill_engine import PrefillEngine, PrefillJob
from tests.test_engine import GREEDY, make_prompts

OPTIONS = dict(dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=32)


@pytest.fixture()
def pair(tiny_model_dir):
    decode = LLM(str(tiny_model_dir), **OPTIONS)
    prefill = build_prefill_engine(EngineConfig(model=str(tiny_model_dir), **OPTIONS), source=decode.engine.source)
    prefill.attach_pool("decode-0", decode.engine.kv_cache)
    return decode, prefill


def run_disaggregated(decode: LLM, prefill: PrefillEngine, prompts: list[list[int]], params: SamplingParams,
                      streamed: bool = False, sink=None):
    """Reserve on the decode side, prefill into those blocks, hand the first token over, decode to the end.
    `streamed`: as for a decode actor on another host, the prefill computes into its own pool and the pages
    are written into the reserved blocks from the result, or with `sink` (tests/test_kv_staging.py RecordingSink)
    from what the sink was sent as the prefill ran."""
    engine = decode.engine
    processor = OutputProcessor(decode.tokenizer)
    computed = {}
    for i, prompt in enumerate(prompts):
        rid = f"d{i}"
        processor.add(rid, None, prompt, params)
        blocks, cached = engine.reserve_remote_prefill(rid, prompt, time.monotonic() + 30)
        job = PrefillJob(rid, prompt, params, blocks, cached, "decode-0", time.monotonic() + 30)
        prefill.add_streamed(job, engine.kv_cache.kv_format, sink) if streamed else prefill.add(job)
    finals = {}
    while prefill.has_work():
        for res in prefill.step():
            for layer, payload in enumerate(res.pages or ()):
                engine.kv_cache.write_pages(layer, res.dest_block_ids, payload)
            for layer, block_ids, payload in sink.pages_of(res.request_id) if sink is not None else ():
                engine.kv_cache.write_pages(layer, block_ids, payload)
            computed[res.request_id] = len(prompts[int(res.request_id[1:])]) - res.num_cached_tokens
            req = EngineRequest(res.request_id, prompts[int(res.request_id[1:])], params)
            updates = engine.add_prefilled_request(req, res.first_token, res.logprobs, res.checksum)
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


def test_streamed_hand_off_carries_exactly_the_missing_pages(pair, tiny_model_dir):
    """For a destination on another host: the pages come back in the result, only for the blocks the
    destination lacks, and written into the reserved blocks they decode exactly as colocated."""
    decode, prefill = pair
    engine = decode.engine
    shared = make_prompts(1, seed=36)[0] * 2
    prompts = [shared + [5, 6, 7], shared + [9, 10, 11, 12]]
    colocated = LLM(str(tiny_model_dir), **OPTIONS).generate(prompts, GREEDY)
    first, shipped_first = run_disaggregated(decode, prefill, prompts[:1], GREEDY, streamed=True)
    second, shipped_second = run_disaggregated(decode, prefill, prompts[1:], GREEDY, streamed=True)
    assert [o.token_ids for o in first + second] == [o.token_ids for o in colocated]
    assert shipped_first["d0"] == len(prompts[0])  # nothing was cached: every page went
    assert second[0].num_cached_tokens == len(shared) // 8 * 8  # the prefix hit: those pages stayed home
    assert set(prefill.pools) == {"decode-0"}  # the private pools are gone
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0


def test_pages_round_trip_as_bytes_and_bad_ones_are_refused(pair):
    decode, _ = pair
    kv = decode.engine.kv_cache
    kv.data.normal_()
    payload = kv.read_pages(1, [3, 7])
    assert len(payload) == 2 * kv.bytes_per_layer_block
    kv.write_pages(1, [10, 11], payload)
    assert torch.equal(kv.data[1][:, [10, 11]], kv.data[1][:, [3, 7]])
    for layer, ids, data in ((1, [10], payload), (99, [10, 11], payload), (1, [10, 10_000], payload)):
        with pytest.raises(ValueError):
            kv.write_pages(layer, ids, data)


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
                                     res.checksum)
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
