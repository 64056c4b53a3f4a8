"""bench/elastic.py's bookkeeping: the three phases' requests, the interactive targets a request is judged by,
goodput per phase, and the elastic server against the best static layout."""
from __future__ import annotations

import math

from bench import elastic as bench
from bench import workloads as wl

PLAN = bench.Plan(10.0, (2.0, 0.5, 0.3), wl.LengthRange(600, 800), wl.LengthRange(100, 120), seed=3)


def record(quadrant: str, prompt: int, ttft: float | None, tpot: float | None, error: str | None = None
           ) -> wl.RequestRecord:
    return wl.RequestRecord("s", 0, quadrant, 0.0, prompt, 16, ttft=ttft, tpot=tpot, error=error)


def test_the_phases_follow_each_other_with_their_own_lengths():
    requests = bench.build_requests(PLAN, wl.PromptMaker())
    assert [r.index for r in requests] == list(range(len(requests)))
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)
    for quadrant, start, _ in PLAN.phases():
        mine = [r for r in requests if r.quadrant == quadrant]
        assert mine and all(start <= r.arrival < start + PLAN.phase_seconds for r in mine)
    assert all(600 <= r.prompt_tokens <= 800 for r in requests if r.quadrant in ("liso", "lilo"))
    assert all(100 <= r.max_tokens <= 120 for r in requests if r.quadrant == "lilo")
    assert bench.build_requests(PLAN, wl.PromptMaker()) == requests  # one seed, the same requests for every server


def test_a_request_is_judged_by_the_target_of_its_prompt_length():
    assert bench.within_targets(record("siso", 100, 0.9, 0.05))
    assert not bench.within_targets(record("siso", 100, 1.1, 0.05))  # short prompt: 1 s
    assert bench.within_targets(record("liso", 1500, 2.9, None))  # long prompt: 3 s, one token (no ITL)
    assert not bench.within_targets(record("lilo", 1500, 0.5, 0.11))  # ITL over 100 ms
    assert not bench.within_targets(record("siso", 100, None, None, error="HTTP 503"))


def test_goodput_per_phase_and_the_elastic_server_against_the_best_static_layout():
    good, slow = record("siso", 100, 0.1, 0.01), record("siso", 100, 5.0, 0.01)
    elastic = bench.summarise([good] * 30 + [record("lilo", 1000, 1.0, 0.05)] * 5, PLAN)
    static = bench.summarise([good] * 20 + [slow] * 10, PLAN)
    assert elastic["siso"].goodput == 3.0 and static["siso"].goodput == 2.0
    assert elastic["all"].goodput == 35 / 30.0 and math.isnan(static["lilo"].attainment)
    compared = bench.comparison({"elastic": elastic, "split": static})
    assert compared["siso"] == {"best_static": "split", "best_static_goodput": 2.0, "elastic_goodput": 3.0,
                                "ratio": 1.5}
    assert compared["lilo"]["ratio"] == math.inf  # the static layout served none of them


def test_the_switches_are_read_from_the_layout_samples():
    samples = [{"t": 1, "layout": "1P+1D", "reason": "a"}, {"t": 2, "layout": "1P+1D", "reason": "b"},
               {"t": 3, "layout": "0P+2D", "reason": "c"}]
    assert bench.switches(samples) == [samples[2]]
