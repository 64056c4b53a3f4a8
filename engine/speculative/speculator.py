"""The engine's side of speculation each step: ask the proposer for drafts for the scheduled slots and return
the step with them added, then tell the proposer what survived. A proposer that fails only turns
speculation off for that step."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Iterable, Sequence

from engine.speculative.proposer import DraftRequest, Proposal, Proposer
from engine.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, proposer: Proposer, vocab_size: int) -> None:
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.num_failures = 0

    def add_drafts(self, sched: SchedulerOutput, tokens_of: Callable[[int], Sequence[int] | None]) -> SchedulerOutput:
        """The step with each speculating chunk's drafts appended to its token_ids (num_draft, draft_probs set);
        `sched` itself when nothing was drafted."""
        self._release([*sched.finished_seq_ids, *sched.preempted_seq_ids])
        chunks = [c for c in sched.chunks if c.num_spec_slots > 0]
        if not chunks:
            return sched
        requests = [DraftRequest(c.seq_id, tokens_of(c.seq_id), c.num_spec_slots, c.params, c.seed,
                                 c.num_prompt_tokens) for c in chunks]
        try:
            proposals = self.proposer.propose(requests)
        except Exception:  # noqa: BLE001 - the requests go on without speculation
            self.num_failures += 1
            log.exception("the proposer failed; this step runs without speculation")
            return sched
        drafted = {c.seq_id: with_drafts(c, p) for c, p in zip(chunks, proposals) if self._valid(c, p)}
        return replace(sched, chunks=tuple(drafted.get(c.seq_id, c) for c in sched.chunks))

    def report(self, sched: SchedulerOutput, result: RunnerOutput, finished: Iterable[int]) -> None:
        """After the scheduler's update: how much of each verified sequence is final; who is gone."""
        for chunk in sched.chunks:
            tokens = result.verified_token_ids.get(chunk.seq_id)
            if tokens is not None:
                self.proposer.on_accepted(chunk.seq_id, chunk.start_pos + len(tokens))  # last token + accepted
        self._release(finished)

    def _release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self.proposer.release(seq_id)

    def _valid(self, chunk: ScheduledChunk, proposal: Proposal) -> bool:
        n = len(proposal.token_ids)
        ok = n <= chunk.num_spec_slots and all(0 <= t < self.vocab_size for t in proposal.token_ids)
        q = proposal.draft_probs
        ok = ok and (q is None or tuple(q.shape) == (n, self.vocab_size))
        if not ok:
            log.warning("dropping a malformed proposal for sequence %d", chunk.seq_id)
        return ok


def with_drafts(chunk: ScheduledChunk, proposal: Proposal) -> ScheduledChunk:
    """The chunk followed by the proposal's draft tokens (the chunk itself for an empty proposal)."""
    if not proposal.token_ids:
        return chunk
    return replace(chunk, token_ids=chunk.token_ids + tuple(proposal.token_ids), num_draft=len(proposal.token_ids),
                   draft_probs=proposal.draft_probs)
