"""The acceptance rule of speculative decoding, as one pure function over a batch of sequences.

For each sequence, draft tokens d_1..d_n were proposed from distributions q_1..q_n (a point mass for
deterministic drafters) and the target produced p_1..p_{n+1} for the same positions. Token d_i is accepted
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is resampled from
normalise(max(0, p_i - q_i)), and when every draft is accepted a bonus token is drawn from p_{n+1}. The
emitted tokens are then distributed exactly as tokens sampled from the target one at a time.

Randomness is an input (uniforms and exponential noise), so the function is deterministic and each caller
draws from its own per-sequence generator. Greedy rows pass uniforms = 0 and noise = 1: a draft is then
accepted iff the target gives it non-zero probability (p is one-hot at the argmax) and the last token is
the target's argmax, which is exactly "longest matching prefix plus the target's next token".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Verdict:
    tokens: torch.Tensor  # [B, K + 1] accepted drafts, then the resampled or bonus token; rest is padding
    num_accepted: torch.Tensor  # [B] accepted drafts per row; row b emits tokens[b, :num_accepted[b] + 1]


def verify_drafts(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  num_drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor) -> Verdict:
    """target_probs [B, K+1, V]; draft_tokens [B, K] int64; draft_probs [B, K, V] or None (point masses);
    num_drafts [B] (row b uses its first num_drafts[b] drafts; the rest is padding); uniforms [B, K] in [0, 1);
    noise [B, V] positive Exp(1) draws for the one final token of each row."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else \
        draft_probs.gather(2, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    in_use = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    accept = (uniforms * q_draft < p_draft) & in_use  # u < p / q without dividing by a zero q
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] length of the leading accepted run
    final_dist = _final_distribution(target_probs, draft_tokens, draft_probs, num_drafts, num_accepted, rows)
    final = (final_dist / noise).argmax(dim=-1)  # [B] exponential race: draws i with prob. final_dist_i
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    tokens[rows, num_accepted] = final
    return Verdict(tokens, num_accepted)


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor) -> Verdict:
    """verify_drafts for greedy rows, from the target's argmax alone (no [B, K+1, V] probabilities):
    target_tokens [B, K+1]; accept the longest prefix of drafts equal to it, then emit its next token."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    in_use = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]  # [B, K]
    num_accepted = ((draft_tokens == target_tokens[:, :k]) & in_use).long().cumprod(dim=1).sum(dim=1)  # [B]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    tokens[rows, num_accepted] = target_tokens[rows, num_accepted]
    return Verdict(tokens, num_accepted)


def _final_distribution(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                        num_drafts: torch.Tensor, num_accepted: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, V] unnormalised: max(0, p - q) at the first rejected position, or p itself after the last draft."""
    p = target_probs[rows, num_accepted]  # [B, V]
    if draft_tokens.shape[1] == 0:
        return p
    at = num_accepted.clamp(max=draft_tokens.shape[1] - 1)  # [B]; only read where a draft was rejected
    if draft_probs is None:
        q = F.one_hot(draft_tokens[rows, at], p.shape[-1]).to(p.dtype)  # [B, V]
    else:
        q = draft_probs[rows, at]  # [B, V]
    rejected = (num_accepted < num_drafts)[:, None]  # [B, 1]
    residual = torch.where(rejected, (p - q).clamp(min=0), p)  # [B, V]
    # p == q exactly leaves nothing to resample from; a rejection then had probability 0, except by rounding.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)
