"""The step records (engine/core/step.py) are immutable, the runner does not depend on the scheduler, and the one
stage that adds data between schedule and run (speculation) returns a new step instead of editing it."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from engine.sampling.sampling_params import SamplingParams
from engine.core.sequence import FinishReason
from engine.speculative.proposer import DraftRequest, Proposal
from engine.speculative.speculator import Speculator
from engine.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput, SequenceUpdate, build_chunk, runner_output

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def chunk(seq_id: int = 0, slots: int = 0) -> ScheduledChunk:
    return build_chunk(seq_id, [5, 6, 7], 2, 1, [3], GREEDY, 0, 2, frozenset({1}), speculative=slots > 0,
                       num_spec_slots=slots)


@pytest.mark.parametrize("record, name", [
    (chunk(), "token_ids"),
    (SchedulerOutput(chunks=(chunk(),)), "chunks"),
    (runner_output({0: 4}), "sampled_token_ids"),
    (SequenceUpdate("r", 0, 4), "finish_reason"),
    (DraftRequest(0, (1, 2), 2, GREEDY), "k"),
    (Proposal((1,)), "token_ids"),
])
def test_assigning_a_field_of_a_step_record_raises(record, name):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, name, None)


def test_step_records_hold_tuples_and_read_only_mappings():
    c = chunk()
    assert (c.token_ids, c.block_table, c.start_pos, c.sample) == ((7,), (3,), 2, True)
    out = runner_output({0: 4}, verified={1: [4, 5]})
    assert out.verified_token_ids[1] == (4, 5)
    with pytest.raises(TypeError):
        out.sampled_token_ids[0] = 9  # type: ignore[index]
    assert dict(RunnerOutput().sampled_token_ids) == {}


def test_every_step_record_is_a_frozen_dataclass_without_list_fields():
    for cls in (ScheduledChunk, SchedulerOutput, RunnerOutput, SequenceUpdate):
        assert cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            assert "list" not in str(f.type) and "dict" not in str(f.type), (cls, f.name, f.type)


def engine_imports(path: Path) -> set[str]:
    """The engine.* modules a source file imports (at any level of the file, TYPE_CHECKING blocks included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] == "engine"}


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def import_closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        path = module_file(current)
        if current in seen or path is None:
            continue
        seen.add(current)
        todo.extend(engine_imports(path))
    return seen


def test_the_runner_does_not_import_the_scheduler():
    assert "engine.core.step" in engine_imports(ROOT / "engine/core/runner.py")
    assert "engine.scheduler" not in import_closure("engine.core.runner")


def test_the_step_module_depends_on_no_stage():
    assert not import_closure("engine.core.step") & {"engine.scheduler", "engine.core.runner",
                                                     "engine.core.engine_core"}


class FixedProposer:
    def __init__(self, tokens: list[int], probs: torch.Tensor | None = None) -> None:
        self.tokens, self.probs, self.released = tokens, probs, []

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.tokens[:r.k], self.probs) for r in requests]

    def on_accepted(self, seq_id: int, num_tokens_kept: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def test_add_drafts_returns_a_new_step_and_leaves_the_scheduled_one_as_it_was():
    sched = SchedulerOutput(chunks=(chunk(0, slots=2), chunk(1)), finished_seq_ids=(7,), preempted_seq_ids=(8,))
    proposer = FixedProposer([9, 10, 11])
    drafted = Speculator(proposer, vocab_size=16).add_drafts(sched, lambda seq_id: [5, 6, 7])
    assert [c.token_ids for c in sched.chunks] == [(7,), (7,)] and sched.chunks[0].num_draft == 0
    assert drafted.chunks[0].token_ids == (7, 9, 10) and drafted.chunks[0].num_draft == 2
    assert drafted.chunks[1] is sched.chunks[1]  # no slots: the same record
    assert (drafted.finished_seq_ids, drafted.preempted_seq_ids) == ((7,), (8,))
    assert proposer.released == [7, 8]


def test_add_drafts_keeps_the_step_when_the_proposal_is_malformed():
    sched = SchedulerOutput(chunks=(chunk(0, slots=2),))
    drafted = Speculator(FixedProposer([9, 99]), vocab_size=16).add_drafts(sched, lambda seq_id: [5, 6, 7])
    assert drafted.chunks == sched.chunks  # token 99 is outside the vocabulary: no drafts


def test_finish_reasons_keep_their_public_values():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
