"""A long prompt's chunk run a few layers a step beside decode steps (SchedulerOutput.layered, with an ITL
target): the greedy outputs equal those of plain chunked prefill, the chunk really ran across steps, an abort
mid-chunk leaks nothing, and the caps on partial prefills still hold."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_core import EngineRequest

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
BUDGET = 40


def prompts(seed: int = 3) -> list[list[int]]:
    """Four short prompts that decode while two long ones (several budgets each) prefill."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (9, 14, 21, 30, 230, 170)]


def tiny_llm(model_dir, **options) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, "max_num_batched_tokens": BUDGET,
               **options}
    return LLM(str(model_dir), **options)


class Spy:
    """Counts the chunks started layer by layer and the steps that advanced one without finishing it."""

    def __init__(self, llm: LLM) -> None:
        self.started = self.partial = 0
        runner = llm.engine.runner
        start, advance = runner.start_layered, runner.advance_layered

        def counted_start(chunk):
            self.started += 1
            return start(chunk)

        def counted_advance(count):
            out = advance(count)
            self.partial += out is None
            return out

        runner.start_layered, runner.advance_layered = counted_start, counted_advance


def assert_pool_clean(llm: LLM) -> None:
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used == 0
    assert llm.engine.runner.layered is None


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    return [out.token_ids for out in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("target", [1e-9, 10.0], ids=["a-layer-a-step", "all-layers-at-once"])
def test_layered_chunks_give_the_tokens_of_plain_chunks(tiny_model_dir, reference, target):
    llm = tiny_llm(tiny_model_dir, itl_target=target)
    spy = Spy(llm)
    outs = llm.generate(prompts(), GREEDY)
    assert [out.token_ids for out in outs] == reference
    assert spy.started >= 4  # both long prompts' chunks went layer by layer
    if target < 1:
        assert spy.partial >= spy.started  # one layer a step: every chunk spans steps
    else:
        assert spy.partial == 1  # only the first advance, before a layer's time is known, runs one layer
    assert_pool_clean(llm)


def test_without_a_target_no_chunk_runs_layer_by_layer(tiny_model_dir, reference):
    llm = tiny_llm(tiny_model_dir)
    spy = Spy(llm)
    assert [out.token_ids for out in llm.generate(prompts(), GREEDY)] == reference
    assert spy.started == 0


def test_an_abort_mid_chunk_frees_everything_and_the_rest_go_on(tiny_model_dir, reference):
    llm = tiny_llm(tiny_model_dir, itl_target=1e-9)
    engine = llm.engine
    for i, prompt in enumerate(prompts()):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
    tokens: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for upd in engine.step():
            if upd.token_id is not None:
                tokens.setdefault(upd.request_id, []).append(upd.token_id)
        in_flight = engine.scheduler.pacing.in_flight
        if not aborted and in_flight is not None and engine.runner.layers_left:
            assert in_flight[0].request_id == "r4"
            engine.abort_request("r4")
            aborted = True
            assert engine.runner.layered is None
            engine.pool.check_integrity()
    assert aborted
    assert [tokens[f"r{i}"] for i in (0, 1, 2, 3, 5)] == [reference[i] for i in (0, 1, 2, 3, 5)]
    assert_pool_clean(llm)


def test_a_second_long_prompt_waits_while_the_first_is_in_flight(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, itl_target=1e-9)
    engine = llm.engine
    for i, prompt in enumerate(prompts()):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        scheduler = engine.scheduler
        if scheduler.pacing.in_flight is not None:
            seen += 1
            partial_long = [seq for seq in scheduler.running
                            if not seq.prefill_done and scheduler.limits.is_long(seq)]
            assert partial_long == [scheduler.pacing.in_flight[0]]  # max_long_partial_prefills = 1
    assert seen > 0
    assert_pool_clean(llm)
