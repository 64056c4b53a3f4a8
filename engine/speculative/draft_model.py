"""A draft model in the engine's process: a second (small) model, or the target's own first N layers, with its
own paged KV cache, proposing K tokens per sequence autoregressively, batched across sequences.

The draft keeps, per sequence, the tokens whose KV it holds. Before proposing it keeps the longest prefix that
still agrees with the sequence (so rejected drafts, preemption and anything else simply roll back), runs the
tokens it has not seen (at least the last one, for its logits), then one single-token step per further draft.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

import torch
from torch import nn

from engine.backends.attention import AttentionMetadata
from engine.kv.block_pool import BlockPool
from engine.config import ModelConfig
from engine.kv.cache import KVCache
from engine.model.llama import LlamaModel
from engine.core.runner import prepare_input
from engine.sampling.sampler import History, SamplingBatch, exponential_race, process_logits
from engine.speculative.proposer import DraftRequest, Proposal
from engine.core.step import ScheduledChunk

DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # the draft's generator must not replay the target's stream


class DraftNet(Protocol):
    cfg: ModelConfig

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor: ...


class LayerPrefixModel(nn.Module):
    """The target's first n decoder layers, then its final norm and LM head: every weight shared, none copied."""

    def __init__(self, target: LlamaModel, num_layers: int) -> None:
        super().__init__()
        if not 1 <= num_layers <= target.cfg.num_layers:
            raise ValueError(f"self:{num_layers} needs 1..{target.cfg.num_layers} layers of the target")
        self.target = target
        self.cfg = replace(target.cfg, num_layers=num_layers, sliding_layers=target.cfg.sliding_layers[:num_layers])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.target(input_ids, positions, meta, kv_caches, num_layers=self.cfg.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


@dataclass
class _DraftSeq:
    computed: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, in order
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class _Active:
    """One sequence being drafted this call."""

    index: int  # in the request list
    request: DraftRequest
    state: _DraftSeq
    next_chunk: list[int]  # tokens to feed at the next draft step
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class DraftModelProposer:
    def __init__(self, model: DraftNet, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = device
        self.kv_cache = KVCache(model.cfg, num_blocks, block_size, dtype, device)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[int, _DraftSeq] = {}

    # ------------------------------------------------------------------ Proposer interface

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        started = [self._start(i, r) for i, r in enumerate(requests) if r.k > 0]
        started = [a for a in started if a is not None]
        active = started
        while active:
            self._draft_step(active)
            active = [a for a in active if len(a.tokens) < a.request.k]
            for a in active:
                a.next_chunk = a.tokens[-1:]
        for a in started:
            proposals[a.index] = Proposal(a.tokens, None if a.request.params.greedy else torch.stack(a.probs))
        return proposals

    def on_accepted(self, seq_id: int, num_tokens_kept: int) -> None:
        state = self.seqs.get(seq_id)
        if state is not None:
            del state.computed[num_tokens_kept:]

    def release(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is not None:
            self.pool.free(reversed(state.block_ids))

    # ------------------------------------------------------------------ drafting

    def _start(self, index: int, request: DraftRequest) -> _Active | None:
        """Roll the sequence's draft KV back to what still agrees, and give it blocks for k more positions."""
        state = self.seqs.get(request.seq_id)
        if state is None:
            state = self.seqs[request.seq_id] = self._new_state(request)
        tokens = request.token_ids
        keep = min(_common_prefix(state.computed, tokens), len(tokens) - 1)  # the last token must run for logits
        del state.computed[keep:]
        num_positions = len(tokens) + request.k - 1  # the last draft is never fed
        if num_positions > self.model.cfg.max_position_embeddings or not self._fit_blocks(state, num_positions):
            return None
        return _Active(index, request, state, list(tokens[keep:]))

    def _new_state(self, request: DraftRequest) -> _DraftSeq:
        if request.seed is None or request.params.greedy:
            return _DraftSeq()
        gen = torch.Generator(device=self.device).manual_seed((request.seed ^ DRAFT_SEED_SALT) % (1 << 63))
        return _DraftSeq(generator=gen)

    def _fit_blocks(self, state: _DraftSeq, num_positions: int) -> bool:
        """Exactly the blocks for num_positions: trailing ones (rolled-back drafts) go back to the pool."""
        need = -(-num_positions // self.pool.block_size)
        extra = state.block_ids[need:]
        del state.block_ids[need:]
        self.pool.free(reversed(extra))
        missing = need - len(state.block_ids)
        if not self.pool.can_allocate(missing):
            return False  # the draft pool is full: no proposal for this sequence this step
        state.block_ids.extend(self.pool.allocate(missing))
        return True

    def _draft_step(self, active: list[_Active]) -> None:
        """Feed each sequence's pending tokens, draw one draft token per sequence from the draft's logits."""
        chunks = [ScheduledChunk(a.request.seq_id, tuple(a.next_chunk), len(a.state.computed),
                                 tuple(a.state.block_ids), True, a.request.params, None) for a in active]
        inp = prepare_input(chunks, self.pool.block_size, self.device)
        hidden = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_cache.layers)  # [T, hidden]
        logits = self.model.compute_logits(hidden[inp.sample_rows])  # [B, V] in inp.sampled_chunks' order
        row_of = {c.seq_id: row for row, c in enumerate(inp.sampled_chunks)}
        logits = logits[[row_of[a.request.seq_id] for a in active]]  # [B, V] in active's order
        batch = SamplingBatch.build([a.request.params for a in active], [None] * len(active), [()] * len(active),
                                    self.device, [_history(a) for a in active])
        probs = process_logits(logits, batch)  # [B, V]
        for a, row, token in zip(active, probs, _draw(probs, active)):
            a.state.computed.extend(a.next_chunk)
            a.tokens.append(token)
            a.probs.append(row)


def _history(a: _Active) -> History | None:
    """The draft is penalised as the target will be: the sequence so far and the drafts before this one. Any
    draft distribution keeps verification exact; this one only makes acceptance likelier."""
    request = a.request
    if not request.params.penalised or request.num_prompt_tokens is None:
        return None
    return History(request.token_ids, request.num_prompt_tokens, tuple(a.tokens))


def _draw(probs: torch.Tensor, active: list[_Active]) -> list[int]:
    """Greedy rows take the argmax (their probs are one-hot); sampled rows draw with their own generator."""
    tokens = probs.argmax(dim=-1)  # [B]
    sampled = [i for i, a in enumerate(active) if not a.request.params.greedy]
    if sampled:
        tokens[sampled] = exponential_race(probs[sampled], [active[i].state.generator for i in sampled])
    return tokens.tolist()


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == list(b[:n]):  # the usual case: the draft is in step with the sequence or behind it
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
