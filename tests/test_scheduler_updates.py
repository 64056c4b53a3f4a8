"""What a step's updates say about their request: only the last sample to finish marks it finished, as the step
saw it. Whoever delivers the rows later (the decode actor's loop, behind the step thread) decides from that mark,
never from the engine's state, which later steps have already moved on."""
from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.core.sequence import Sequence
from engine.core.step import runner_output

EOS = 99


def two_samples() -> tuple[Scheduler, list[Sequence]]:
    scheduler = Scheduler(BlockPool(16, 4), SchedulerLimits(64, 4), (EOS,))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=2)
    seqs = [Sequence(i, "r", i, [1, 2, 3], 3, params, 3 + 4) for i in range(2)]
    scheduler.add(seqs)
    return scheduler, seqs


def marks(updates) -> list[tuple[int, str | None, bool]]:
    return [(u.sample_index, u.finish_reason, u.request_finished) for u in updates]


def test_samples_finishing_in_two_steps_mark_the_request_once_on_the_last():
    scheduler, _ = two_samples()
    first = scheduler.update(step := scheduler.schedule(), runner_output({c.seq_id: EOS if c.seq_id == 0 else 5
                                                                          for c in step.chunks}))
    second = scheduler.update(scheduler.schedule(), runner_output({1: EOS}))
    assert marks(first) == [(0, "stop", False), (1, None, False)]
    assert marks(second) == [(1, "stop", True)]
    assert not scheduler.by_request  # by the time a late deliverer of `first` looked, the request was gone


def test_samples_finishing_in_one_step_mark_the_request_on_the_second():
    scheduler, _ = two_samples()
    updates = scheduler.update(scheduler.schedule(), runner_output({0: EOS, 1: EOS}))
    assert marks(updates) == [(0, "stop", False), (1, "stop", True)]


def test_an_abort_marks_the_request_on_its_last_sample():
    scheduler, _ = two_samples()
    scheduler.update(scheduler.schedule(), runner_output({0: 5, 1: 6}))
    assert marks(scheduler.abort("r", sample_index=0)) == [(0, "abort", False)]
    assert marks(scheduler.abort("r")) == [(1, "abort", True)]
