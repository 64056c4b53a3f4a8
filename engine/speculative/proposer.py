"""What a drafter implements. The engine asks for K proposals per speculating sequence each step and reports
back how much of each sequence survived verification, so drafters with state (a draft model's KV) keep up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    token_ids: Sequence[int]  # the sequence so far (prompt + output); read-only for the proposer
    k: int  # propose at most this many tokens
    params: SamplingParams  # a sampling drafter draws from the request's processed distribution
    seed: int | None = None  # per-sequence seed of a seeded request, for the drafter's own generator
    num_prompt_tokens: int | None = None  # where the output starts in token_ids; None = unknown (drafts unpenalised)


@dataclass(frozen=True)
class Proposal:
    token_ids: Sequence[int]  # at most k tokens; empty = no proposal this step
    draft_probs: torch.Tensor | None = None  # [len(token_ids), V] the distributions drawn from; None = point masses


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def on_accepted(self, seq_id: int, num_tokens_kept: int) -> None:
        """The sequence's first `num_tokens_kept` tokens are final; anything drafted beyond them is stale."""

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop its state (idempotent)."""
