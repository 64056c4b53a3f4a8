"""A stream resumed on a fresh engine from the tokens it already emitted (what the router does when a decode
actor dies or drains) continues with exactly the tokens an uninterrupted run gives: greedy, seeded sampling
(draws keyed by position), penalties, grammars, n > 1, speculation, and through a prefill engine's hand-off."""
from __future__ import annotations

import time

import pytest

from engine.core.builder import build_prefill_engine
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineRequest, RequestError
from engine.core.prefill_engine import PrefillJob
from engine.core.step import position_seed
from engine.sampling.structured import Guide
from tests.test_engine import make_prompts

OPTIONS = dict(dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)
PROMPTS = make_prompts(3, seed=21)
CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "penalised": SamplingParams(max_tokens=24, temperature=0.8, seed=7, frequency_penalty=1.5,
                                presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True),
    "min_tokens": SamplingParams(max_tokens=24, temperature=1.0, seed=3, min_tokens=20),
}


def uninterrupted(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([prompt], params)[0].outputs]


def resumed(llm: LLM, prompt: list[int], params: SamplingParams, emitted: dict[int, list[int]],
            rid: str = "r") -> dict[int, list[int]]:
    """Resume `emitted` on `llm`'s engine: sample index -> the tokens produced after the resume point."""
    engine = llm.engine
    engine.add_request(EngineRequest(rid, prompt, params, resume=emitted))
    out: dict[int, list[int]] = {i: [] for i in emitted}
    while engine.has_unfinished_requests():
        for update in engine.step():
            if update.token_id is not None:
                out[update.sample_index].append(update.token_id)
    engine.pool.check_integrity()
    return out


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), **OPTIONS)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 9, 17])
def test_resumed_stream_continues_exactly(llm, case, cut):
    params = CASES[case]
    for prompt in PROMPTS:
        (reference,) = uninterrupted(llm, prompt, params)
        assert resumed(llm, prompt, params, {0: reference[:cut]})[0] == reference[cut:]


def test_seeded_sampling_is_keyed_by_position_not_by_draw_count(llm):
    """The property migration relies on: a seeded sequence's draws depend on (seed, position) only. A batch
    neighbour, a preemption or a restart does not shift them; different seeds do differ."""
    prompt = PROMPTS[0]
    alone = uninterrupted(llm, prompt, CASES["seeded"])
    crowd = llm.generate([prompt, *PROMPTS[1:]], CASES["seeded"])[0].outputs[0].token_ids
    other_seed = uninterrupted(llm, prompt, SamplingParams(**{**CASES["seeded"].__dict__, "seed": 99}))
    assert alone[0] == crowd
    assert other_seed[0] != alone[0]
    assert position_seed(5, 10) != position_seed(5, 11) != position_seed(6, 10)


def test_n_samples_resume_each_from_its_own_tokens(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=42, n=3, ignore_eos=True)
    prompt = PROMPTS[1]
    reference = uninterrupted(llm, prompt, params)
    assert len({tuple(r) for r in reference}) > 1  # the samples differ, so a mix-up would show
    emitted = {0: reference[0][:5], 2: reference[2][:11]}  # sample 1 finished before the cut
    out = resumed(llm, prompt, params, emitted)
    assert out == {0: reference[0][5:], 2: reference[2][11:]}


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_resume_with_speculation(tiny_model_dir, mode):
    spec = dict(speculative="ngram") if mode == "ngram" else dict(speculative="draft", draft_model="self:1")
    llm = LLM(str(tiny_model_dir), **OPTIONS, **spec)
    params = CASES["greedy"]
    for prompt in PROMPTS:
        (reference,) = uninterrupted(llm, prompt, params)
        assert resumed(llm, prompt, params, {0: reference[:10]})[0] == reference[10:]


def test_grammar_resume_keeps_the_constraint(llm):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, guide=Guide("regex", "[a-z]{3,12}-[0-9]{2,6}"))
    prompt = PROMPTS[2]
    (reference,) = uninterrupted(llm, prompt, params)
    assert len(reference) > 4
    assert resumed(llm, prompt, params, {0: reference[:3]})[0] == reference[3:]


def test_resume_through_a_prefill_engine_hand_off(llm, tiny_model_dir):
    """Disaggregated resume: the prefill engine computes prompt + emitted tokens into the decode engine's
    reserved blocks (penalties count the emitted ones as output), and decoding goes on from there."""
    prefill = build_prefill_engine(EngineConfig(model=str(tiny_model_dir), **OPTIONS), source=llm.engine.source)
    prefill.attach_pool("decode-0", llm.engine.kv_cache)
    engine = llm.engine
    for name in ("greedy", "penalised"):
        params = CASES[name]
        prompt = PROMPTS[0]
        (reference,) = uninterrupted(llm, prompt, params)
        req = EngineRequest(f"h-{name}", prompt, params, resume={0: reference[:8]})
        blocks, cached = engine.reserve_remote_prefill(req.request_id, req.context_token_ids, time.monotonic() + 30)
        prefill.add(PrefillJob(req.request_id, req.context_token_ids, params, blocks, cached, "decode-0",
                               time.monotonic() + 30, num_prompt_tokens=len(prompt)))
        results = []
        while prefill.has_work():
            results += prefill.step()
        (res,) = results
        tokens = [u.token_id for u in engine.add_prefilled_request(req, res.first_token, None, res.checksum)]
        while engine.has_unfinished_requests():
            tokens += [u.token_id for u in engine.step() if u.token_id is not None]
        assert tokens == reference[8:], name
        engine.pool.check_integrity()
    assert not prefill.runner.generators  # a finished job leaves no sampler state behind


def test_bad_resumes_are_refused(llm):
    params = SamplingParams(max_tokens=8)
    bad = {"no sample": {}, "sample outside n": {1: [5]}, "token outside the vocabulary": {0: [10 ** 6]}}
    for why, resume in bad.items():
        with pytest.raises(RequestError) as err:
            llm.engine.add_request(EngineRequest(f"bad-{len(why)}", PROMPTS[0], params, resume=resume))
        assert err.value.param == "resume", why
    assert not llm.engine.has_unfinished_requests()
