"""What a request's first pass over its prompt computes beyond the KV, for the requests that ask: the prompt's
log-probabilities (vLLM's prompt_logprobs) and an embedding (the final hidden states pooled).

The pass may span several steps (chunked prefill). Each chunk's rows are read as the chunk runs: its logits
score the prompt tokens its rows predict (the chunk carries the token after it, which its last row predicts),
and its hidden states add to the pooled sum. What the chunks gave is kept per sequence until the chunk that
ends the prompt, whose step delivers it (step.PromptResult) with the request's first token; then the state
goes. A pass cut short (preemption, abort) is dropped, and a pass that runs again starts afresh at position 0.

A pass that reads every position (prompt logprobs, mean pooling) never starts from a cached prefix
(engine/scheduler/blocks.py: the prefix cache kept the KV of those positions, not their hidden states). Last-token
pooling reads only the last prompt row, which always runs, so it may.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

from engine.core.step import PromptResult, ScheduledChunk
from engine.sampling.sampler import TokenLogprobs

SCORE_ROWS = 256  # prompt rows scored per LM-head product: bounds the [rows, vocab] fp32 logits held at once


class HasLogits(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def pass_rows(chunk: ScheduledChunk) -> range:
    """The rows of `chunk` (offsets into its tokens) that its request's prompt outputs read: every row for prompt
    logprobs or mean pooling, the prompt's last row for last-token pooling, none outside a prompt pass."""
    if not chunk.prompt_pass:
        return range(0)
    n = len(chunk.token_ids)
    if chunk.params.reads_every_prompt_position:
        return range(n)
    return range(n - 1, n) if chunk.sample else range(0)


def score_prompt(model: HasLogits, hidden: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprobs]:
    """hidden [R, H]: rows whose next tokens are `targets` [R] -> each target's logprob under the model's fp32
    logits, its rank (1 = the likeliest) and the `top` likeliest tokens with theirs."""
    out: list[TokenLogprobs] = []
    for lo in range(0, len(targets), SCORE_ROWS):
        logp = torch.log_softmax(model.compute_logits(hidden[lo:lo + SCORE_ROWS]).float(), dim=-1)  # [r, V]
        wanted = torch.tensor(targets[lo:lo + SCORE_ROWS], dtype=torch.long, device=logp.device)
        chosen = logp.gather(1, wanted[:, None])  # [r, 1]
        ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = logp.topk(top, dim=-1)
        for row, (token, lp) in enumerate(zip(wanted.tolist(), chosen.squeeze(1).tolist())):
            out.append(TokenLogprobs(token, lp, list(zip(top_ids[row].tolist(), top_vals[row].tolist())), ranks[row]))
    return out


def pooled(total: torch.Tensor, count: int) -> tuple[float, ...]:
    """The mean of `count` rows summed in `total` [H] fp32, L2-normalised."""
    vector = total / max(count, 1)
    return tuple(torch.nn.functional.normalize(vector, dim=0).tolist())


@dataclass
class _PassState:
    next_pos: int  # the position the pass's next chunk starts at
    starts_at: int  # where the pass began: 0, or after a cached prefix (last-token pooling only)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1.. scored so far
    total: torch.Tensor | None = None  # pooling: the sum of the rows read (fp32)
    count: int = 0


class PromptPasses:
    """The prompt passes in progress on one runner, by sequence id."""

    def __init__(self) -> None:
        self._states: dict[int, _PassState] = {}

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the passes of sequences that finished or were preempted (a pass that runs again starts afresh)."""
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    def add(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, model: HasLogits) -> dict[int, PromptResult]:
        """hidden: the final hidden states of each chunk's pass_rows, chunk after chunk. Returns what the passes
        that end with these chunks computed, by sequence id."""
        results = {}
        start = 0
        for chunk in chunks:
            rows = len(pass_rows(chunk))
            result = self._add(chunk, hidden[start:start + rows], model)
            start += rows
            if result is not None:
                results[chunk.seq_id] = result
        return results

    def _add(self, chunk: ScheduledChunk, hidden: torch.Tensor, model: HasLogits) -> PromptResult | None:
        state = self._state(chunk)
        params = chunk.params
        if params.prompt_logprobs is not None:
            targets = chunk.token_ids[1:] + (() if chunk.next_prompt_token is None else (chunk.next_prompt_token,))
            state.logprobs += score_prompt(model, hidden[:len(targets)], targets, params.prompt_logprobs)
        if params.pooling == "mean":
            rows = hidden.float().sum(dim=0)
            state.total = rows if state.total is None else state.total + rows
            state.count += len(hidden)
        elif params.pooling == "last" and chunk.sample:
            state.total, state.count = hidden[-1].float(), 1
        state.next_pos = chunk.start_pos + len(chunk.token_ids)
        if not chunk.sample:
            return None
        del self._states[chunk.seq_id]
        return PromptResult(None if params.prompt_logprobs is None else (None, *state.logprobs),
                            None if params.pooling is None else pooled(state.total, state.count))

    def _state(self, chunk: ScheduledChunk) -> _PassState:
        """The sequence's pass, begun afresh where this chunk starts a pass; a chunk that does not continue its
        pass where the last one ended is a scheduling bug (a cached prefix under a pass that reads it all)."""
        state = self._states.get(chunk.seq_id)
        if state is None or chunk.start_pos == 0:
            state = self._states[chunk.seq_id] = _PassState(chunk.start_pos, chunk.start_pos)
        if state.next_pos != chunk.start_pos or (state.starts_at and chunk.params.reads_every_prompt_position):
            raise RuntimeError(f"the prompt pass of sequence {chunk.seq_id} resumes at position {chunk.start_pos}, "
                               f"after {state.next_pos}, from {state.starts_at}: positions were skipped")
        return state
