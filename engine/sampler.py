"""Batched token sampling with per-row temperature / top-k / top-p, bans, seeds and logprobs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams

Argmax = Callable[[torch.Tensor], torch.Tensor]  # [B, V] -> [B] int64, the first maximal index of each row


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one decode step, as device tensors plus host-side flags."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    max_logprobs: int | None  # None = no row wants logprobs
    num_logprobs: list[int | None]
    generators: list[torch.Generator | None]
    banned: list[tuple[int, ...]]
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, cols) flattened

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              banned: list[tuple[int, ...]], device: torch.device | str) -> SamplingBatch:
        assert len(params) == len(generators) == len(banned)
        greedy = [p.greedy for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            needs_top_k=any(k > 1 and not g for k, g in zip(top_k, greedy)),
            needs_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            max_logprobs=max(wanted) if wanted else None,
            num_logprobs=[p.logprobs for p in params],
            generators=list(generators),
            banned=[tuple(b) for b in banned],
            ban_index=_ban_index(banned, device),
        )

    @property
    def size(self) -> int:
        return len(self.generators)


def _ban_index(banned: list[tuple[int, ...]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    if not rows:
        return None
    cols = [t for ids in banned for t in ids]
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and the row's top-N alternatives (raw logits, descending)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None entries for rows that did not ask


def _apply_bans(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.ban_index is None:
        return logits
    return logits.index_put(batch.ban_index, torch.tensor(float("-inf"), device=logits.device))


def _apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)  # [B, V] in sorted order
    if batch.needs_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab)  # [B]
        keep = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    if batch.needs_top_p:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        mass_before = F.pad(cum[:, :-1], (1, 0))  # exclusive cumsum; 0 for the top token, so it is always kept
        top_p = batch.top_p[:, None]
        keep = keep & ((mass_before < top_p) | (top_p >= 1.0))
    keep_vocab = torch.empty_like(keep).scatter_(1, order, keep)  # [B, V] back in vocab order
    return logits.masked_fill(~keep_vocab, float("-inf"))


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Return the exact per-row distribution that ``sample`` draws from: probs [B, V] float32."""
    logits = _apply_bans(logits.float(), batch)  # [B, V]
    temperature = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # [B, V]
    if batch.needs_top_k or batch.needs_top_p:
        scaled = _apply_top_k_top_p(scaled, batch)
    probs = scaled.softmax(dim=-1)  # [B, V]
    if batch.any_greedy:
        one_hot = F.one_hot(row_argmax(logits), logits.shape[-1]).to(probs.dtype)  # [B, V]
        probs = torch.where(batch.greedy[:, None], one_hot, probs)
    return probs


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exp(1) noise [B, V]; seeded rows draw from their own generator so batch makeup cannot affect them."""
    q = torch.empty_like(probs)
    if any(g is None for g in batch.generators):
        q.exponential_()
    for row, g in enumerate(batch.generators):
        if g is not None:
            q[row].exponential_(generator=g)
    # exponential_ may return exactly 0, which would turn 0/q into NaN and win argmax.
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i."""
    return (probs / _exponential_noise(probs, batch)).argmax(dim=-1)  # [B]


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[TokenLogprobs | None]:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()  # [B]
    token_ids = tokens.tolist()
    top_vals, top_ids = logp.topk(batch.max_logprobs, dim=-1)  # [B, N]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = []
    for row, n in enumerate(batch.num_logprobs):
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[row][:n], top_vals[row][:n]))
        out.append(TokenLogprobs(token_ids[row], chosen[row], top))
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64: argmax's answer (the first maximal index; NaN counts as the maximum) by max(dim),
    which takes about half argmax's time at a batch's vocabulary-wide logits (docs/performance.md)."""
    return x.max(dim=-1).indices


def greedy_tokens(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = row_argmax) -> torch.Tensor:
    """The argmax of each row of logits [B, V] after the row's bans: [B] int64."""
    return argmax(_apply_bans(logits, batch))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[TokenLogprobs | None]:
    """Logprobs of given tokens [B] under raw logits [B, V], for the rows of ``batch`` that asked for them."""
    return _logprobs(logits, tokens, batch) if batch.max_logprobs is not None else [None] * batch.size


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of probs [B, V] (unnormalised is fine), each row from its own generator: [B] int64."""
    noise = torch.empty_like(probs)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = row_argmax) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, V] (any float dtype: all but a plain greedy pick run in fp32);
    logprobs come from the raw (unprocessed) logits. `argmax` makes greedy picks (row_argmax's contract)."""
    if batch.all_greedy and batch.max_logprobs is None:
        return SamplerOutput(token_ids=greedy_tokens(logits, batch, argmax).tolist(), logprobs=None)
    logits = logits.float()
    if batch.all_greedy:
        tokens = greedy_tokens(logits, batch, argmax)  # [B]
    else:
        tokens = _draw(process_logits(logits, batch), batch)  # [B]
    logprobs = _logprobs(logits, tokens, batch) if batch.max_logprobs is not None else None
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)
