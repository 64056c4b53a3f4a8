"""The records one engine step passes along, in one direction only:

    Scheduler.schedule() -> SchedulerOutput
    [Speculator.add_drafts(SchedulerOutput) -> SchedulerOutput]   (only when the engine speculates)
    ModelRunner.run(SchedulerOutput) -> RunnerOutput
    Scheduler.update(SchedulerOutput, RunnerOutput) -> [SequenceUpdate]

Every record is frozen and holds tuples or read-only mappings: a stage that wants a different value builds
a new record (dataclasses.replace), so what the runner ran is exactly what the scheduler later reads back.
The runner depends on this module, never on the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # annotations only: this module depends on nothing at run time
    import torch

    from engine.sampling.sampler import TokenLogprobs
    from engine.sampling.sampling_params import SamplingParams
    from engine.speculative.adaptive import SpecCounts


def _empty_map() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one sequence that run this step, and what the runner needs to place them."""

    seq_id: int
    token_ids: tuple[int, ...]  # [n] the tokens to run; with drafts: (last known token, *drafts)
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_table: tuple[int, ...]  # the sequence's KV block ids, covering start_pos + n (+ draft slots) positions
    sample: bool  # the chunk reaches the end of the known tokens, so its last row yields the next token
    params: SamplingParams
    seed: int | None  # per-sequence sampler seed (request seed mixed with the sample index)
    banned_token_ids: tuple[int, ...] = ()  # EOS / stop ids while under min_tokens
    speculative: bool = False  # a decode step of a speculating sequence (its adaptive K learns from it)
    num_spec_slots: int = 0  # draft tokens budgeted (tokens and blocks) after token_ids[0]
    num_draft: int = 0  # draft tokens filled in: token_ids = (last token, *drafts)
    draft_probs: torch.Tensor | None = None  # [num_draft, V] the drafts' distributions; None = point masses
    # What the penalties count and the grammar follows, for a chunk that samples under penalised or guided
    # params (else ()): every token the sequence holds (prompt, then output) before the token this chunk
    # samples or its drafts.
    history: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    # the block tables of KV-cache groups 1.. (engine/kv/groups.py), each as long as block_table, with
    # NULL_BLOCK where a windowed group gave a block back; () in the plain layout
    extra_tables: tuple[tuple[int, ...], ...] = ()
    # Part of a request's first pass over its prompt, when the request asks for what that pass computes (prompt
    # logprobs, an embedding: engine/core/prompt_pass.py); with it, the prompt token after this chunk (None where
    # the chunk ends the prompt), which the chunk's last row predicts.
    prompt_pass: bool = False
    next_prompt_token: int | None = None

    @property
    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        """One table per KV-cache group, group 0 first."""
        return (self.block_table, *self.extra_tables)

    @property
    def sample_position(self) -> int:
        """The position of the token this chunk samples (its first emitted token when it verifies drafts):
        the sequence's length before the step, wherever and however the sequence got there."""
        return self.start_pos + len(self.token_ids) - self.num_draft


@dataclass(frozen=True)
class SchedulerOutput:
    """What runs in one forward pass, and the runner-side state to drop or move before it."""

    chunks: tuple[ScheduledChunk, ...]  # decode chunks and prefill chunks, in scheduling order
    finished_seq_ids: tuple[int, ...] = ()  # finished since the last step: drop their runner state
    preempted_seq_ids: tuple[int, ...] = ()  # preempted this step: their KV is gone, they recompute later
    compressions: tuple[tuple[int, int], ...] = ()  # (hot block, cold block) pages to compress before the forward
    # A long prompt's chunk that starts now and runs a few layers a step beside the decode steps that follow, until
    # its last layer (engine/scheduler/step_times.py); its result comes back through Scheduler.finish_layered.
    layered: ScheduledChunk | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class PromptResult:
    """What a request's prompt pass computed, delivered with its first token."""

    # prompt_logprobs: one entry per prompt position, None at position 0 (nothing predicts the first token)
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    embedding: tuple[float, ...] | None = None  # pooling: the pooled final hidden state, L2-normalised (fp32)


@dataclass(frozen=True)
class RunnerOutput:
    """What one forward pass produced, keyed by seq_id (read-only mappings)."""

    sampled_token_ids: Mapping[int, int] = field(default_factory=_empty_map)  # chunks that sample, without drafts
    logprobs: Mapping[int, TokenLogprobs] = field(default_factory=_empty_map)  # ... of those that asked for them
    # Chunks with drafts: the emitted tokens (accepted drafts, then the target's own token) and their logprobs
    verified_token_ids: Mapping[int, tuple[int, ...]] = field(default_factory=_empty_map)
    verified_logprobs: Mapping[int, tuple[TokenLogprobs | None, ...]] = field(default_factory=_empty_map)
    prompt_results: Mapping[int, PromptResult] = field(default_factory=_empty_map)  # chunks that end a prompt pass


def runner_output(sampled: Mapping[int, int], logprobs: Mapping[int, TokenLogprobs] | None = None,
                  verified: Mapping[int, Sequence[int]] | None = None,
                  verified_logprobs: Mapping[int, Sequence[TokenLogprobs | None]] | None = None) -> RunnerOutput:
    """A RunnerOutput over read-only copies of the given mappings."""
    return RunnerOutput(MappingProxyType(dict(sampled)), MappingProxyType(dict(logprobs or {})),
                        MappingProxyType({k: tuple(v) for k, v in (verified or {}).items()}),
                        MappingProxyType({k: tuple(v) for k, v in (verified_logprobs or {}).items()}))


@dataclass(frozen=True)
class SequenceUpdate:
    """One sampled token (or a finish without one, e.g. abort) for one sequence: the step's result for the
    front end, and what travels over the wire."""

    request_id: str
    sample_index: int
    token_id: int | None
    finish_reason: str | None = None  # the public value of FinishReason ("stop", "length", "abort")
    logprobs: TokenLogprobs | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: SpecCounts | None = None  # on the update that finishes a speculating sequence: its drafts in total
    # On the update that finishes the request's last unfinished sample, as the step saw it: whoever delivers
    # the step's rows later (another thread) must not read the engine's state, which later steps have moved on.
    request_finished: bool = False
    prompt: PromptResult | None = None  # on the first token of a request that asked for its prompt pass's outputs


def build_chunk(seq_id: int, token_ids: Sequence[int], start: int, num_new: int, block_table: Sequence[int],
                params: SamplingParams, sample_index: int, num_prompt_tokens: int, eos_token_ids: frozenset[int],
                speculative: bool = False, num_spec_slots: int = 0,
                extra_tables: Sequence[Sequence[int]] = (), prompt_pass: bool = False) -> ScheduledChunk:
    """The next `num_new` tokens of a sequence from `start`; it samples when it reaches the last known token.
    `prompt_pass`: the sequence is in its prompt pass (Sequence.in_prompt_pass)."""
    under_min = len(token_ids) - num_prompt_tokens < params.min_tokens
    banned = tuple(eos_for(params, eos_token_ids)) + params.stop_token_ids if under_min else ()
    sample = start + num_new == len(token_ids)
    next_token = token_ids[start + num_new] if prompt_pass and not sample else None
    return ScheduledChunk(seq_id=seq_id, token_ids=tuple(token_ids[start:start + num_new]), start_pos=start,
                          block_table=tuple(block_table), sample=sample, params=params,
                          seed=sequence_seed(params.seed, sample_index), banned_token_ids=banned,
                          speculative=speculative, num_spec_slots=num_spec_slots,
                          history=tuple(token_ids) if sample and (params.penalised or params.masks_tokens) else (),
                          num_prompt_tokens=num_prompt_tokens, extra_tables=tuple(map(tuple, extra_tables)),
                          prompt_pass=prompt_pass, next_prompt_token=next_token)


def eos_for(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    return frozenset() if params.ignore_eos else eos_token_ids


def sequence_seed(seed: int | None, sample_index: int) -> int | None:
    """Each of a request's n samples draws from its own RNG stream derived from the request's seed."""
    return None if seed is None else (seed * 1_000_003 + sample_index) % (1 << 63)


def position_seed(seed: int, position: int) -> int:
    """The seed of the draws that sample the token at `position`. Randomness keyed by position, not by a
    generator that advances with every draw, makes a seeded sequence's text a function of (seed, tokens so
    far): it continues exactly on another actor, after a hand-off, a preemption or a migration, with no RNG
    state to carry. (A splitmix64 step: nearby positions get unrelated seeds; re-seeding costs about 1 us.)"""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
