"""Steps paced to an inter-token latency target (engine/scheduler/pacing.py, step_times.py), on the scheduler
alone with counted steps, a fake cost per step and a fake runner of layers: the costs are learnt from the steps;
a step carrying decodes then fits the target, cut where a prefill beside them is short-in, and a long prompt's
whole chunk runs a few layers a step; every prefill progresses, a long prompt alone keeps whole budgets, and the
pool's integrity holds after every step."""
from __future__ import annotations

import pytest

from client.async_llm import _actor_engine_options
from engine.config import ConfigError, EngineConfig
from engine.kv.block_pool import BlockPool
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.scheduler.step_times import MIN_UNITS, SMOOTHING, StepTimes
from engine.core.sequence import Sequence
from engine.core.step import runner_output
from router.elastic_settings import ElasticSettings

BUDGET = 256
BLOCK = 4
DECODE_SECONDS = 0.010  # the fake machine: a step of decodes takes this
UNIT_SECONDS = 0.002  # and each prefill unit beside them this much more
LAYERS = 6  # the fake model's layers
LAYER_SECONDS = 0.03  # a layer of a whole budget's chunk running layer by layer (a smaller chunk's: pro rata)


def fake_seconds(decodes: int, units: int) -> float:
    return (DECODE_SECONDS if decodes else 0.0) + UNIT_SECONDS * units


class Run:
    def __init__(self, itl_target: float | None) -> None:
        self.pool = BlockPool(2048, BLOCK)
        self.limits = SchedulerLimits(BUDGET, 16, itl_target=itl_target)
        self.scheduler = Scheduler(self.pool, self.limits, (99,))
        self.next_id = 0
        self.seconds: list[float] = []  # per step, what the fake machine took (the layers run after it too)
        self.layered: list = []  # [chunk, layers left] of the chunk in flight
        self.layered_chunks = 0

    def add(self, prompt_len: int, max_tokens: int = 1000, long_prompt: bool | None = None) -> Sequence:
        tokens = [self.next_id * 10_000 + i for i in range(prompt_len)]
        seq = Sequence(self.next_id, f"r{self.next_id}", 0, tokens, prompt_len, SamplingParams(max_tokens=max_tokens),
                       prompt_len + max_tokens, arrival_time=float(self.next_id), long_prompt=long_prompt)
        self.next_id += 1
        self.scheduler.add([seq])
        return seq

    def step(self) -> dict[int, int]:
        """One engine step (EngineCore.step's order): the planned chunks, then layers of the chunk in flight.
        -> tokens each sequence ran (a layered chunk's when its last layer ran)."""
        out = self.scheduler.schedule()
        running = {seq.seq_id: seq for seq in self.scheduler.running}
        decodes = sum(1 for c in out.chunks if running[c.seq_id].in_decode)
        units = sum(self.limits.run_cost(running[c.seq_id], len(c.token_ids)) for c in out.chunks
                    if not running[c.seq_id].in_decode)
        if out.layered is not None:
            self.layered = [out.layered, LAYERS]
            self.layered_chunks += 1
        self.scheduler.update(out, runner_output({c.seq_id: 5 for c in out.chunks if c.sample}))
        seconds = fake_seconds(decodes, units)
        self.scheduler.pacing.step_took(seconds)
        ran = {c.seq_id: len(c.token_ids) for c in out.chunks}
        if self.layered:
            chunk, left = self.layered
            count = self.scheduler.pacing.layers_to_run(left, seconds)
            assert 1 <= count <= left
            layers_seconds = count * LAYER_SECONDS * len(chunk.token_ids) / BUDGET
            self.scheduler.pacing.layers_took(count, layers_seconds)
            seconds += layers_seconds
            self.layered[1] -= count
            if not self.layered[1]:
                self.scheduler.finish_layered(runner_output({chunk.seq_id: 5} if chunk.sample else {}))
                ran[chunk.seq_id] = len(chunk.token_ids)
                self.layered = []
        self.seconds.append(seconds)
        self.pool.check_integrity()
        return ran


def test_step_times_learn_the_decode_part_and_the_cost_of_a_unit():
    times = StepTimes()
    assert times.units_within(0.1) is None
    times.observe(4, 0, 0.010)
    assert times.units_within(0.1) is None  # no prefill seen yet
    times.observe(4, 100, 0.210)
    assert times.decode_seconds == pytest.approx(0.010) and times.unit_seconds == pytest.approx(0.002)
    assert times.units_within(0.1) == 45
    assert times.units_within(0.001) == MIN_UNITS  # a prefill always progresses
    times.observe(0, MIN_UNITS - 1, 9.0)  # too few units to teach anything
    assert times.unit_seconds == pytest.approx(0.002)
    times.observe(0, 100, 0.400)  # a prefill alone: no decode part to take off
    assert times.unit_seconds == pytest.approx(0.002 + SMOOTHING * (0.004 - 0.002))


def test_without_a_target_a_step_beside_decodes_keeps_the_whole_budget():
    run = Run(itl_target=None)
    decoding = [run.add(8) for _ in range(4)]
    run.step()
    long = run.add(5000, long_prompt=True)
    for _ in range(6):
        ran = run.step()
    assert ran[long.seq_id] == BUDGET - len(decoding)


def test_steps_beside_decodes_fit_the_target_once_learnt_and_a_prefill_always_progresses():
    target = 0.1
    run = Run(itl_target=target)
    decoding = [run.add(8) for _ in range(4)]
    for _ in range(3):
        run.step()  # prefills, then decodes alone: the decode part
    long = run.add(5000, long_prompt=False)  # short-in by its quadrant, yet many steps long: cut, not layered
    progress = []
    for _ in range(30):
        ran = run.step()
        assert all(ran[seq.seq_id] == 1 for seq in decoding)  # the decodes run every step
        progress.append(ran[long.seq_id])
    assert all(n >= MIN_UNITS for n in progress)
    # the four prompts' prefill taught a unit's cost, the decodes alone theirs: every step fits at once
    assert max(run.seconds[-30:]) <= target * 1.01
    assert min(run.seconds[-30:]) >= target * 0.9  # and none is cut further than the target asks


def test_a_step_beside_decodes_is_whole_until_a_unit_has_been_seen():
    run = Run(itl_target=0.1)
    decoding = [run.add(8) for _ in range(4)]
    for _ in range(3):
        run.step()
    run.scheduler.pacing.times = StepTimes(decode_seconds=DECODE_SECONDS)  # decodes seen, no prefill unit yet
    long = run.add(5000, long_prompt=False)
    first, second = run.step(), run.step()
    assert first[long.seq_id] == BUDGET - len(decoding)
    assert second[long.seq_id] == int((0.1 - DECODE_SECONDS) / UNIT_SECONDS)  # learnt from the first


def test_a_short_prompt_arriving_during_a_cut_long_prefill_starts_within_two_steps():
    run = Run(itl_target=0.1)
    for _ in range(2):
        run.add(8)
    for _ in range(3):
        run.step()
    long = run.add(5000, long_prompt=True)
    for _ in range(10):
        run.step()
    assert run.layered_chunks > 0
    short = run.add(20, long_prompt=False)
    started = [short.seq_id in run.step() for _ in range(2)]
    assert any(started)
    assert long.num_computed_tokens < long.num_prompt_tokens  # still prefilling beside it


def test_a_long_prompt_beside_decodes_runs_whole_chunks_layer_by_layer_within_the_target():
    target = 0.1
    run = Run(itl_target=target)
    decoding = [run.add(8) for _ in range(4)]
    for _ in range(3):
        run.step()
    long = run.add(3000, long_prompt=True)
    chunks = []
    while not long.prefill_done:
        ran = run.step()
        assert all(ran[seq.seq_id] == 1 for seq in decoding)  # the decodes run every step
        if long.seq_id in ran:
            chunks.append(ran[long.seq_id])
    assert chunks[1:-1] == [BUDGET] * (len(chunks) - 2)  # after its admission's cut chunk: whole budgets
    assert run.layered_chunks == len(chunks) - 1
    steps = run.seconds[-(len(chunks) * 2):]
    # the first advance runs one layer to learn a layer's time; after it, every step fits the target
    assert max(steps[2:]) <= target * 1.01
    assert long.num_output_tokens == 1  # the chunk that ended the prompt sampled its first token


def test_a_long_prompt_alone_is_never_cut():
    run = Run(itl_target=0.05)
    long = run.add(3000)
    assert [run.step()[long.seq_id] for _ in range(5)] == [BUDGET] * 5


def test_the_actors_get_the_serve_itl_target_unless_the_config_names_its_own():
    assert _actor_engine_options(EngineConfig(), ElasticSettings(slo_itl=0.25))["itl_target"] == 0.25
    assert _actor_engine_options(EngineConfig(itl_target=0.05), ElasticSettings(slo_itl=0.25))["itl_target"] == 0.05
    with pytest.raises(ConfigError, match="itl_target must be positive"):
        EngineConfig(itl_target=0.0)


def test_the_layers_that_fit_are_learnt_from_the_layers_run_and_scale_with_the_chunk():
    times = StepTimes()
    assert times.layers_within(1.0, 100) == 1  # nothing seen: one layer, the safe guess
    times.observe_layers(4, 100, 0.040)
    assert times.layers_within(0.095, 100) == 9
    assert times.layers_within(0.095, 200) == 4  # a chunk twice the cost (deeper in its prompt): half the layers
    assert times.layers_within(-0.5, 100) == 1  # the step overran the target: the chunk still progresses
    times.observe_layers(0, 100, 5.0)  # nothing ran: nothing learnt
    assert times.layer_unit_seconds == pytest.approx(0.0001)
