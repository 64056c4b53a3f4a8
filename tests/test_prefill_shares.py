"""Stall-free prefill sharing (engine/scheduler/shares.py), on the scheduler alone with counted steps: a short
request that arrives while a long prompt prefills starts within a step; the long prompt progresses every step
by at least its floor and takes back what the short ones leave; a second long prompt waits for the first
without holding up short ones; the pool's integrity holds after every scenario."""
from __future__ import annotations

import math

import pytest

from engine.config import ConfigError, PrefillShares
from engine.kv.block_pool import BlockPool
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.scheduler.planning import tokens_to_run
from engine.core.sequence import Sequence
from engine.core.step import runner_output

BUDGET = 64
BLOCK = 4
EOS = 99


class Run:
    """A scheduler stepped by hand: every step samples token 5 for each sequence that ends its prefill or
    decodes, so nothing finishes before max_tokens."""

    def __init__(self, shares: PrefillShares = PrefillShares(), num_blocks: int = 512,
                 attention_span: int | None = None) -> None:
        self.pool = BlockPool(num_blocks, BLOCK)
        self.limits = SchedulerLimits(BUDGET, 16, shares=shares, attention_span=attention_span)
        self.scheduler = Scheduler(self.pool, self.limits, (EOS,))
        self.next_id = 0
        self.steps: list[dict[int, int]] = []  # per step: seq_id -> tokens run

    def add(self, prompt_len: int, max_tokens: int = 4, long_prompt: bool | None = None) -> Sequence:
        tokens = [self.next_id * 10_000 + i for i in range(prompt_len)]  # no prefix shared with another prompt
        seq = Sequence(self.next_id, f"r{self.next_id}", 0, tokens, prompt_len,
                       SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens,
                       arrival_time=float(self.next_id), long_prompt=long_prompt)
        self.next_id += 1
        self.scheduler.add([seq])
        return seq

    def step(self) -> dict[int, int]:
        ready = sum(1 for seq in self.scheduler.waiting if seq.ready_to_admit())
        shared = len(self.scheduler.running) + ready > 1
        out = self.scheduler.schedule()
        ran = {c.seq_id: len(c.token_ids) for c in out.chunks}
        assert sum(ran.values()) <= BUDGET
        running = {seq.seq_id: seq for seq in self.scheduler.running}
        spent = sum(self.limits.run_cost(running[c.seq_id], len(c.token_ids), shared) for c in out.chunks)
        assert spent <= BUDGET  # in a shared step, deep prompt tokens cost more than 1
        sampled = {c.seq_id: 5 for c in out.chunks if c.sample}
        self.scheduler.update(out, runner_output(sampled))
        self.pool.check_integrity()
        self.steps.append(ran)
        return ran


def first_step_of(run: Run, seq: Sequence) -> int:
    return next(i for i, ran in enumerate(run.steps) if seq.seq_id in ran)


def test_a_short_prompt_starts_in_the_step_after_it_arrives_during_a_long_prefill():
    run = Run()
    long = run.add(1000)
    for _ in range(3):
        assert run.step() == {long.seq_id: BUDGET}  # alone, the long prefill takes the whole budget
    short = run.add(12)
    ran = run.step()
    assert ran[short.seq_id] == 12  # the whole short prompt in one step: its first token now
    assert ran[long.seq_id] == BUDGET - 12  # and the long one keeps everything else


def test_the_long_prefill_keeps_its_floor_however_many_short_prompts_arrive():
    shares = PrefillShares(long_prefill_slowdown=2.0)
    run = Run(shares)
    long = run.add(2000)
    run.step()
    for _ in range(20):
        for _ in range(3):  # more short demand than the reserve can take each step; no decodes after
            run.add(15, max_tokens=1)
        ran = run.step()
        assert ran[long.seq_id] >= math.ceil(BUDGET / shares.long_prefill_slowdown)


def test_short_prompts_beyond_the_reserve_are_admitted_within_a_bounded_number_of_steps():
    shares = PrefillShares(long_prefill_slowdown=2.0)
    run = Run(shares)
    long = run.add(3000)
    run.step()
    shorts = [run.add(20) for _ in range(6)]  # 120 tokens of short demand, 32 tokens of reserve per step
    for _ in range(8):
        run.step()
    assert all(any(s.seq_id in ran for ran in run.steps) for s in shorts)
    assert max(first_step_of(run, s) for s in shorts) <= 1 + math.ceil(120 / 32)
    assert all(long.seq_id in ran for ran in run.steps)  # it never stopped


def test_what_the_short_prompts_leave_goes_back_to_the_long_prefill():
    """A short prompt that cannot get its blocks does not start; its held share returns to the long one."""
    run = Run(num_blocks=40)  # 160 token slots
    long = run.add(150)
    run.step()  # 64 tokens, 16 blocks
    short = run.add(100)  # cannot fit beside the long prompt's growth: 25 blocks more than are free
    ran = run.step()
    assert short.seq_id not in ran
    assert ran[long.seq_id] == BUDGET


def test_a_second_long_prompt_waits_for_the_first_and_a_short_one_behind_it_does_not():
    run = Run()
    first = run.add(300)
    run.step()
    second = run.add(300)
    short = run.add(10)
    ran = run.step()
    assert second.seq_id not in ran and ran[short.seq_id] == 10
    while not first.prefill_done:
        ran = run.step()
        assert second.seq_id not in ran or first.prefill_done
    steps_to_start = 0
    while second.seq_id not in run.step():
        steps_to_start += 1
    assert steps_to_start == 0  # it starts in the step after the first one's prefill ends


def test_without_a_quadrant_a_prompt_is_long_when_it_outgrows_one_step():
    run = Run()
    a = run.add(3 * BUDGET)  # long by length
    run.step()
    b = run.add(BUDGET + 1, long_prompt=False)  # short by its quadrant, whatever its length: a share for it
    ran = run.step()
    assert b.seq_id in ran and ran[a.seq_id] >= math.ceil(BUDGET / PrefillShares().long_prefill_slowdown)


def test_the_partial_prefill_cap_holds():
    shares = PrefillShares(max_partial_prefills=2, max_long_partial_prefills=1)
    run = Run(shares)
    seqs = [run.add(100, long_prompt=False) for _ in range(4)]  # none fits one step: all become partial
    for _ in range(6):
        run.step()
        partial = [s for s in seqs if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        assert len(partial) <= 2


def test_decodes_run_every_step_during_a_long_prefill():
    run = Run()
    streams = [run.add(8, max_tokens=50) for _ in range(4)]
    run.step()  # their prefills
    long = run.add(2000)
    for _ in range(10):
        ran = run.step()
        assert all(ran.get(s.seq_id) == 1 for s in streams) and ran[long.seq_id] == BUDGET - 4


@pytest.mark.parametrize("slowdown", [0.5, float("nan")])
def test_bad_shares_are_refused(slowdown):
    with pytest.raises(ConfigError, match="long_prefill_slowdown"):
        PrefillShares(long_prefill_slowdown=slowdown)
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        PrefillShares(max_partial_prefills=1, max_long_partial_prefills=2)


# ---------------------------------------------------------------------------------------- costs by context


@pytest.mark.parametrize("span", [None, 1, 7, 100])
def test_chunk_tokens_is_the_most_the_budget_pays_for(span):
    limits = SchedulerLimits(BUDGET, 16, attention_span=span)
    for context in (0, 1, 13, 64, 500, 5000):
        for budget in (0, 1, 5, 64, 300):
            n = limits.chunk_tokens(context, budget)
            assert limits.chunk_cost(context, n) <= budget < limits.chunk_cost(context, n + 1)


def test_a_chunk_costs_its_tokens_plus_their_attention_in_token_units():
    limits = SchedulerLimits(BUDGET, 16, attention_span=100)
    assert limits.chunk_cost(0, 1) == 1 and limits.chunk_cost(0, 50) == 50 + 50 * 49 // 200
    assert limits.chunk_cost(100, 10) == 10 + 10 * 209 // 200  # each token sees about its span of context: x2
    for context, a, b in ((0, 10, 30), (250, 7, 64), (1000, 1, 1)):  # a run split in two costs about the same
        parts = limits.chunk_cost(context, a) + limits.chunk_cost(context + a, b)
        assert parts <= limits.chunk_cost(context, a + b) <= parts + 1
    assert SchedulerLimits(BUDGET, 16).chunk_cost(1000, 10) == 10  # no span: tokens
    assert SchedulerLimits(BUDGET, 16, enable_chunked_prefill=False, attention_span=100).chunk_cost(1000, 10) == 10


def test_a_long_prompts_chunks_shrink_as_its_context_grows_and_steps_keep_their_cost():
    span = 100
    run = Run(attention_span=span)
    long, streams = run.add(1200), [run.add(8, max_tokens=400) for _ in range(2)]
    chunks = []
    while not long.prefill_done:
        ran = run.step()
        chunks.append(ran.get(long.seq_id, 0))
    assert sum(chunks) == 1200 and all(n > 0 for n in chunks)  # it progresses every step
    assert all(a >= b for a, b in zip(chunks[2:], chunks[3:-1]))  # after the streams' prompts, never growing
    assert chunks[2] > 4 * chunks[-2] and chunks[-2] <= run.limits.chunk_tokens(1200 - chunks[-1] - chunks[-2], BUDGET)
    assert all(s.seq_id in ran for ran in run.steps[2:] for s in streams)  # the decodes ran every step


def test_a_long_prompt_alone_takes_whole_budgets_at_any_depth():
    run = Run(attention_span=10)
    long = run.add(600)
    while not long.prefill_done:
        run.step()
    assert [ran[long.seq_id] for ran in run.steps] == [BUDGET] * (600 // BUDGET) + [600 % BUDGET]
    short = run.add(8)  # the long one now decodes beside a new prompt: a shared step
    assert run.step() == {long.seq_id: 1, short.seq_id: 8}


def test_a_prompt_token_dearer_than_a_whole_budget_still_runs_one_a_step():
    limits = SchedulerLimits(BUDGET, 16, attention_span=1)
    seq = Sequence(0, "r0", 0, list(range(400)), 400, SamplingParams(max_tokens=1), 401)
    seq.num_computed_tokens = 300  # one more token costs 1 + 300: past the budget of 64
    assert limits.chunk_cost(300, 1) > BUDGET
    assert tokens_to_run(seq, BUDGET, limits) == 1 and tokens_to_run(seq, 0, limits) == 0
