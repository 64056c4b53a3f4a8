"""Per-sequence state kept by the scheduler. One request with n samples owns n sequences."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling.sampling_params import SamplingParams
from engine.speculative.adaptive import SpecCounts, SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a sequence finished; the values are the finish_reason strings the API returns."""

    STOP = "stop"  # an EOS or stop token id
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # aborted by the client or the engine


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int
    token_ids: list[int]  # prompt followed by every sampled token
    num_prompt_tokens: int
    params: SamplingParams
    max_total_tokens: int  # prompt + max_tokens, capped by the model's context
    priority: int = 0
    arrival_time: float = 0.0
    wait_for: "Sequence | None" = None  # sibling whose prompt must be in the prefix cache first (n > 1)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at first admission
    # one block table per KV-cache group (engine/kv/groups.py), all of one length; a windowed group's leading
    # `released_blocks` entries are NULL_BLOCK, their blocks given back
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    released_blocks: int = 0
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks registered so far
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    spec: SpecState | None = None  # None: this sequence never speculates
    spec_counts: SpecCounts = SpecCounts()  # its drafts so far
    compress_first: bool = False  # adaptive KV compression takes this sequence's old pages before others'
    long_prompt: bool | None = None  # its quadrant is long-in (engine/scheduler/shares.py); None: judged by length

    @property
    def block_ids(self) -> list[int]:
        """Group 0's table (live: the compactor rewrites entries in place); the whole table of a plain layout."""
        return self.block_tables[0]

    @property
    def in_decode(self) -> bool:
        """Only the last sampled token lacks KV: the next step is a decode step."""
        return self.num_uncomputed == 1 and self.prefill_done

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def in_prompt_pass(self) -> bool:
        """Its first pass over the prompt, in a request that asks for what that pass computes (prompt logprobs,
        an embedding): sample 0 of the request, before its first token. A preempted pass runs again."""
        return self.params.prompt_outputs and self.sample_index == 0 and self.num_tokens == self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower is served first: priority, then arrival (FCFS), then creation order."""
        return (self.priority, self.arrival_time, self.seq_id)

    def ready_to_admit(self) -> bool:
        sibling = self.wait_for
        return sibling is None or sibling.is_finished or sibling.prefill_done
