"""The thinking budget: past `tokens` inside an open think block the engine forces the closing tag, through the
same logit mask as a grammar's (engine/sampling/thinking_budget.py, engine/core/runner.py)."""
from __future__ import annotations

import pytest

from engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from engine.sampling.thinking_budget import INSIDE, forced_rows, must_close, thinking_spent
from tests.tiny_tokenizer import QWEN3_TEMPLATE, R1_TEMPLATE, THINK_TOKENS

OPEN, CLOSE = 900, 901


def test_spent_counts_the_tokens_inside_an_open_block_only():
    assert thinking_spent((5, INSIDE, CLOSE), [1, 2, 3]) == 3
    assert thinking_spent((5, OPEN, CLOSE), [1, 2, 3]) is None  # never opened: no thinking
    assert thinking_spent((5, OPEN, CLOSE), [1, OPEN, 2, 3]) == 2
    assert thinking_spent((5, OPEN, CLOSE), [OPEN, 2, CLOSE, 4, 5]) is None  # closed already
    assert thinking_spent((5, INSIDE, CLOSE), [1, CLOSE, 3]) is None


def test_the_close_is_forced_exactly_when_the_budget_is_spent():
    budget = (2, OPEN, CLOSE)
    assert [must_close(budget, out) for out in ([OPEN], [OPEN, 1], [OPEN, 1, 2], [OPEN, 1, 2, CLOSE])] == \
        [False, False, True, False]
    assert must_close((0, INSIDE, CLOSE), [])  # a budget of 0: the output closes at once


def test_each_draft_position_is_judged_by_the_history_before_it():
    assert forced_rows((2, INSIDE, CLOSE), [7], [8, CLOSE, 9]) == [False, True, False, False]
    assert forced_rows((1, OPEN, CLOSE), [], [OPEN, 5, 6]) == [False, False, True, True]


@pytest.mark.parametrize("value", [(1, 2), (-1, INSIDE, CLOSE), (1, -2, CLOSE), (1, 2, -1), (True, 2, 3), "x"])
def test_a_malformed_budget_is_refused_naming_the_field(value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(thinking_budget=value)
    assert err.value.param == "thinking_budget"


def test_a_budget_from_the_wire_is_a_tuple():
    assert SamplingParams(thinking_budget=[3, INSIDE, CLOSE]).thinking_budget == (3, INSIDE, CLOSE)
    assert SamplingParams(thinking_budget=[3, INSIDE, CLOSE]).masks_tokens


# ---------------------------------------------------------------------------------------- in the engine

@pytest.fixture(scope="module")
def budget_dir(tmp_path_factory):
    from tests.tiny_models import tiny_llama_config, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-budget"), tiny_llama_config(), seed=7,
                            template=QWEN3_TEMPLATE, added_tokens=THINK_TOKENS)


@pytest.fixture(scope="module")
def llm(budget_dir):
    from engine import LLM

    return LLM(str(budget_dir), dtype="float32", num_kv_blocks=64, block_size=8)


def _tags(llm):
    return [llm.front_door.encode(tag, False)[0] for tag in THINK_TOKENS]


@pytest.mark.engine
def test_an_output_that_starts_inside_closes_after_its_budget(llm):
    _, close = _tags(llm)
    prompt = llm.front_door.encode("<think>\nLet me see", False)
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    assert close not in free.token_ids[:5]  # the model would not close by itself
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, thinking_budget=(4, INSIDE, close))
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids[:4] == free.token_ids[:4]  # within the budget, the output is the model's own
    assert out.token_ids[4] == close


@pytest.mark.engine
def test_a_budget_and_a_grammar_apply_together(llm):
    from engine.sampling.structured import Guide

    open_id, close = _tags(llm)
    grammar = Guide("grammar", 'root ::= "<think>" [a-z ]* "</think>" "ok"')
    params = SamplingParams(max_tokens=30, temperature=0, guide=grammar, thinking_budget=(3, open_id, close))
    out = llm.generate([llm.front_door.encode("Hi", False)], params)[0].outputs[0]
    ids = list(out.token_ids)
    assert ids[0] == open_id and ids[4] == close, out.text
    assert out.text.endswith("</think>ok")


@pytest.mark.engine
def test_the_front_door_sets_the_budget_where_the_output_may_think(llm, tmp_path_factory):
    from frontend.front_door import ThinkingBudgetError

    door = llm.front_door
    open_id, close = _tags(llm)
    ask = [{"role": "user", "content": "Hi"}]
    on = door.chat(ask)
    params, _ = door.with_reasoning(SamplingParams(), on.prompt, budget=5)
    assert params.thinking_budget == (5, open_id, close)  # Qwen3: the model opens the block itself
    off = door.chat(ask, template_kwargs={"enable_thinking": False})
    assert door.with_reasoning(SamplingParams(), off.prompt, budget=5)[0].thinking_budget is None
    with pytest.raises(ThinkingBudgetError, match="does not think"):
        type(door)(door.tokenizer, door.tool_format, None).with_reasoning(SamplingParams(), on.prompt, budget=5)


@pytest.mark.engine
@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_model="self:1")],
                         ids=["ngram", "self:1"])
def test_verified_drafts_keep_the_budget(llm, budget_dir, options):
    """With speculation, each draft is judged by the mask at its position: the output is plain decoding's."""
    from tests.test_spec_decode import run, tiny_llm

    _, close = _tags(llm)
    prompts = [llm.front_door.encode("<think>\nLet me see, " * (i + 1), False) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, thinking_budget=(5, INSIDE, close))
    plain = run(llm, prompts, params)
    speculating = tiny_llm(budget_dir, **options)
    assert run(speculating, prompts, params, speculate=[True] * 3) == plain
    assert all(tokens[5] == close and close not in tokens[:5] for tokens in plain)
    assert speculating.engine.stats().spec_proposed > 0
