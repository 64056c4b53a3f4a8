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
from engine.core.sequence import Sequence
from engine.core.step import runner_output

BUDGET = 64
BLOCK = 4
EOS = 99


class Run:
    """A scheduler stepped by hand: every step samples token 5 for each sequence that ends its prefill or
    decodes, so nothing finishes before max_tokens."""

    def __init__(self, shares: PrefillShares = PrefillShares(), num_blocks: int = 512) -> None:
        self.pool = BlockPool(num_blocks, BLOCK)
        self.scheduler = Scheduler(self.pool, SchedulerLimits(BUDGET, 16, shares=shares), (EOS,))
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
        out = self.scheduler.schedule()
        ran = {c.seq_id: len(c.token_ids) for c in out.chunks}
        assert sum(ran.values()) <= BUDGET
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
