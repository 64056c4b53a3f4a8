"""How outputs reach a stream's reader: every token, or several per output (StreamInterval), with outputs
that pile up merged; first tokens and finishes never held; text and tokens always whole and in order."""
from __future__ import annotations

import asyncio

import pytest

from client.async_llm import _OutputStream
from engine import AsyncLLM, LLM, SamplingParams
from engine.core.output_processor import OutputProcessor
from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.core.step import SequenceUpdate
from engine.core.stream_interval import (AUTO_MAX_TOKENS, AUTO_MAX_WAIT_S, AUTO_OUTPUTS_PER_SECOND, AUTO_OUTPUTS_PER_STEP,
                                        StreamInterval)
from tests.test_engine import make_prompts
from engine.model.tokenizer import Tokenizer



# ---------------------------------------------------------------------------------------- the interval

def test_a_fixed_interval_ignores_the_number_of_streams():
    assert [StreamInterval(3).tokens(n) for n in (1, 10, 100)] == [3, 3, 3]


def test_auto_sends_every_token_until_the_budget_then_groups_up_to_the_cap():
    auto = StreamInterval.parse("auto")
    assert [auto.tokens(n) for n in range(1, AUTO_OUTPUTS_PER_STEP + 1)] == [1] * AUTO_OUTPUTS_PER_STEP
    assert auto.tokens(AUTO_OUTPUTS_PER_STEP + 1) == 2
    assert auto.tokens(2 * AUTO_OUTPUTS_PER_STEP) == 2
    assert auto.tokens(8 * AUTO_OUTPUTS_PER_STEP) == min(8, AUTO_MAX_TOKENS)
    assert auto.tokens(1000 * AUTO_OUTPUTS_PER_STEP) == AUTO_MAX_TOKENS


def test_auto_keeps_the_output_rate_where_the_step_time_is_known_and_holds_nothing_in_slow_steps():
    auto = StreamInterval.parse("auto")
    step = 2 / AUTO_OUTPUTS_PER_SECOND  # the steps at which the rate is the unknown-step rule's two a step
    assert [auto.tokens(n, step) for n in (1, 2, 3, 4, 8, 16, 1000)] == [auto.tokens(n) for n in (1, 2, 3, 4, 8, 16,
                                                                                                   1000)]
    assert auto.tokens(4, 5 * step) == 1  # a long prompt's chunk beside the decodes: every token goes at once
    assert auto.tokens(40, 5 * step) == 4
    assert auto.tokens(4, 0.0) == AUTO_MAX_TOKENS  # updates back to back: as many as the cap
    assert StreamInterval(3).tokens(4, 5 * step) == 3


@pytest.mark.parametrize("bad", ["0", "-2", "fast", "1.5"])
def test_a_bad_interval_is_refused_with_its_value(bad):
    with pytest.raises(ValueError, match=repr(bad) if not bad.lstrip("-").isdigit() else "at least 1"):
        StreamInterval.parse(bad)


# ---------------------------------------------------------------------------------------- the processor

@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_hf_folder(tiny_model_dir)


def _feed(processor: OutputProcessor, token_ids: list[int], hold: int, finish_at_end: str = "length"):
    """One update per step; returns the outputs each step emitted."""
    per_step = []
    for i, tok in enumerate(token_ids):
        finish = finish_at_end if i == len(token_ids) - 1 else None
        outputs, _ = processor.process([SequenceUpdate("r", 0, tok, finish_reason=finish)], hold)
        per_step.append(outputs)
    return per_step


def test_held_outputs_go_out_every_n_tokens_with_the_first_and_the_finish_at_once(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog again and again")[:10]
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=len(ids)))
    per_step = _feed(processor, ids, hold=3)
    emitted_at = [i for i, outs in enumerate(per_step) if outs]
    assert emitted_at == [0, 3, 6, 9]  # the first token, then every third new token, and the finish
    deltas = [outs[0].outputs[0].delta_token_ids for outs in per_step if outs]
    assert deltas == [ids[:1], ids[1:4], ids[4:7], ids[7:10]]
    assert per_step[-1][0].finished and per_step[-1][0].outputs[0].token_ids == ids


def test_auto_holds_no_token_past_its_wait_and_a_fixed_interval_holds_to_its_count():
    assert StreamInterval.parse("auto").max_wait == AUTO_MAX_WAIT_S and StreamInterval(4).max_wait is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("step_seconds,emitted_at", [
    (0.01, [0, 4, 8, 9]),  # fast steps: every fourth token, as the count says, and the finish
    (0.1, [0, 3, 6, 9]),  # the third step after an output passes 0.25 s: out before the count
    (0.3, list(range(10))),  # slow steps: every token
])
def test_a_held_output_goes_out_once_its_wait_passes(tokenizer, step_seconds, emitted_at):
    """Steps counted on a fake clock: an output is due at `hold` tokens or `max_wait` seconds after the last."""
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog again and again")[:10]
    clock = FakeClock()
    processor = OutputProcessor(tokenizer, clock=clock)
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=len(ids)))
    per_step = []
    for i, tok in enumerate(ids):
        clock.now += step_seconds
        update = SequenceUpdate("r", 0, tok, finish_reason="length" if i == len(ids) - 1 else None)
        per_step.append(processor.process([update], hold=4, max_wait=0.25)[0])
    assert [i for i, outs in enumerate(per_step) if outs] == emitted_at
    assert [t for outs in per_step for out in outs for t in out.outputs[0].delta_token_ids] == ids


def test_held_text_adds_up_to_the_unheld_text_with_a_stop_string_held_back(tokenizer):
    text = "one two three four five six seven eight nine ten"
    ids = tokenizer.encode(text)
    params = SamplingParams(max_tokens=len(ids), stop=["five six"])
    texts = {}
    for hold in (1, 2, 4):
        processor = OutputProcessor(tokenizer)
        processor.add("r", None, [1], params)
        outs = [o for step in _feed(processor, ids, hold) for o in step]
        texts[hold] = "".join(o.outputs[0].delta_text for o in outs)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
        assert "five" not in texts[hold]
    assert texts[1] == texts[2] == texts[4] and texts[1].startswith("one two three four")


@pytest.mark.parametrize("stop,reason", [(["five six"], "five six"), (["nowhere"], None)])
def test_the_output_names_the_stop_string_that_ended_it(tokenizer, stop, reason):
    ids = tokenizer.encode("one two three four five six seven")
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1], SamplingParams(max_tokens=len(ids), stop=stop))
    outs = [o for step in _feed(processor, ids, hold=1) for o in step]
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop" if reason else "length", reason)
    assert last.after(outs[-2].outputs[0]).stop_reason == reason  # merged outputs keep it


def test_a_sample_that_finishes_is_not_held_behind_its_sibling(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1], SamplingParams(n=2, max_tokens=8))
    processor.process([SequenceUpdate("r", 0, 5), SequenceUpdate("r", 1, 6)], 4)  # the first output
    held, _ = processor.process([SequenceUpdate("r", 0, 7), SequenceUpdate("r", 1, 8)], 4)
    assert held == []
    outs, _ = processor.process([SequenceUpdate("r", 1, 9, finish_reason="length")], 4)
    assert len(outs) == 1 and outs[0].outputs[1].finish_reason == "length"
    assert outs[0].outputs[1].delta_token_ids == [8, 9] and outs[0].outputs[0].delta_token_ids == [7]


# ---------------------------------------------------------------------------------------- merging queued outputs

def _output(new: list[int], everything: list[int], finished: bool = False) -> RequestOutput:
    sample = CompletionOutput(0, "".join(map(str, everything)), list(everything), "length" if finished else None,
                              None, "".join(map(str, new)), list(new))
    return RequestOutput("r", None, [1], [sample], RequestMetrics(0.0), finished=finished)


async def test_outputs_queued_behind_one_are_merged_in_order():
    stream = _OutputStream()
    for new, upto in (([1], [1]), ([2, 3], [1, 2, 3]), ([4], [1, 2, 3, 4])):
        stream.put(_output(new, upto))
    merged = await stream.next()
    assert merged.outputs[0].delta_token_ids == [1, 2, 3, 4] and merged.outputs[0].delta_text == "1234"
    assert merged.outputs[0].token_ids == [1, 2, 3, 4]
    stream.put(_output([5], [1, 2, 3, 4, 5], finished=True))
    stream.put(_output([6], [1, 2, 3, 4, 5, 6]))  # nothing may be merged past a finish
    assert (await stream.next()).finished


async def test_an_error_waits_behind_the_outputs_before_it():
    stream = _OutputStream()
    stream.put(_output([1], [1]))
    stream.put(_output([2], [1, 2]))
    stream.put(RuntimeError("actor lost"))
    first = await stream.next()
    assert isinstance(first, RequestOutput) and first.outputs[0].delta_token_ids == [1, 2]
    assert isinstance(await stream.next(), RuntimeError)


# ---------------------------------------------------------------------------------------- through AsyncLLM

@pytest.mark.engine
@pytest.mark.parametrize("interval", [1, 3, "auto"])
async def test_streams_read_whole_in_order_at_any_interval(tiny_model_dir, interval, monkeypatch):
    """What each stream's reader gets adds up to the plain output. The first token's output goes out alone (what
    the streams are given: a reader that falls behind gets it merged with the next, by design)."""
    given: dict[int, list[int]] = {}
    put = _OutputStream.put

    def record(stream, item):
        if isinstance(item, RequestOutput):
            given.setdefault(id(stream), []).append(len(item.outputs[0].delta_token_ids))
        put(stream, item)

    monkeypatch.setattr(_OutputStream, "put", record)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = make_prompts(6, seed=4)
    reference = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8).generate(prompts, greedy)
    llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8, stream_interval=interval)

    async def one(prompt):
        outs = [out async for out in llm.generate(prompt, greedy)]
        return outs, "".join(o.outputs[0].delta_text for o in outs), [t for o in outs for t in o.outputs[0].delta_token_ids]

    try:
        results = await asyncio.gather(*(one(p) for p in prompts))
    finally:
        llm.shutdown()
    for (outs, text, tokens), ref in zip(results, reference):
        assert tokens == ref.token_ids and text == ref.text
    assert len(given) == len(prompts) and all(counts[0] == 1 for counts in given.values())  # first never held
    if interval == 3:
        assert all(len(outs) <= 1 + -(-23 // 3) for outs, _, _ in results)


@pytest.mark.engine
async def test_closing_a_held_stream_aborts_it_within_one_step(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8, stream_interval=8)
    steps = {"n": 0}
    step = llm.engine.step

    def counted_step():
        steps["n"] += 1
        return step()

    llm.engine.step = counted_step
    try:
        stream = llm.generate(make_prompts(1, seed=9)[0], SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        await anext(stream)  # eight more tokens: the stream is in the middle of holding
        await stream.aclose()
        at_close = steps["n"]
        for _ in range(500):
            if not llm.engine.has_work():
                break
            await asyncio.sleep(0.01)
        assert not llm.engine.has_work() and llm.stats().kv_blocks_used == 0
        assert steps["n"] - at_close <= 1
    finally:
        llm.shutdown()
