"""Batched token sampling with per-row temperature / top-k / top-p / min-p, bans, logit biases, penalties, seeds
and logprobs.

The order is vLLM's, after the grammar masks of constrained rows (structured outputs): logit_bias and bans, then the repetition penalty, then the frequency and presence
penalties (all on the raw logits, so greedy rows see them too); then temperature, min-p, top-k and top-p.
Every step is a tensor op over the whole batch (or over the rows that need it); a batch in which no row asks
for a control skips that control's work entirely.

On a GPU the dense part (temperature, min-p, top-k/top-p, the softmax and the greedy rows' one-hots) runs as
`dense_distribution`, branch-free over the batch, which the backend compiles into fused kernels
(Backend.fuse): one compiled variant with the vocabulary sort, one without, each dynamic in the row count.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured import mask_logits

Argmax = Callable[[torch.Tensor], torch.Tensor]  # [B, V] -> [B] int64, the first maximal index of each row
Dense = Callable[..., torch.Tensor]  # dense_distribution, or the backend's compiled version of it
Index = tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), flattened


@dataclass(frozen=True)
class History:
    """The tokens a row's penalties count: the sequence so far (prompt, then output) and, at a verified draft
    position, the drafts before that position (output tokens too). Rows may share one `token_ids` object (the
    positions of one verified chunk): its ints are then converted once."""

    token_ids: Sequence[int]
    num_prompt_tokens: int
    drafts: Sequence[int] = ()


@dataclass
class Penalties:
    """The penalised rows of a batch and the tokens their penalties touch, as (row, token) pairs: one pair per
    occurrence, so a token's count is its number of output pairs. Rows are numbered among the penalised ones."""

    rows: torch.Tensor | None  # [P] the batch rows with penalties; None = every row, in order
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    needs_presence_frequency: bool
    needs_repetition: bool
    output_pairs: Index  # output tokens, the drafts before a verified position included
    prompt_pairs: Index | None  # prompt tokens; only for the repetition penalty


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
    ban_index: Index | None
    bias_index: Index | None = None
    bias_values: torch.Tensor | None = None  # [N] float32, one per bias_index entry
    min_p: torch.Tensor | None = None  # [B] float32; None = no sampled row uses min-p
    penalties: Penalties | None = None
    grammar_rows: torch.Tensor | None = None  # [G] int64 the rows under a grammar; None = no row is
    grammar_bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32, bit t % 32 of word t // 32 = allowed

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              banned: list[tuple[int, ...]], device: torch.device | str,
              histories: Sequence[History | None] | None = None,
              grammar: tuple[Sequence[int], torch.Tensor] | None = None) -> SamplingBatch:
        """`histories`: per row, the tokens its penalties count; a penalised row without one counts nothing.
        `grammar`: (rows, their int32 bitmask of allowed tokens) for the rows under a grammar."""
        assert len(params) == len(generators) == len(banned)
        assert histories is None or len(histories) == len(params)
        greedy = [p.greedy for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        controls = _controls(params, histories, device) if any(_has_controls(p) for p in params) else {}
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
            **controls,
            **({} if grammar is None else dict(grammar_rows=_long(grammar[0], device),
                                               grammar_bitmask=grammar[1].to(device))),
        )

    @property
    def size(self) -> int:
        return len(self.generators)


def _has_controls(p: SamplingParams) -> bool:
    return p.adjusts_logits or (p.min_p > 0 and not p.greedy)


def _controls(params: list[SamplingParams], histories: Sequence[History | None] | None,
              device: torch.device | str) -> dict:
    """The SamplingBatch fields of logit_bias, min-p and the penalties (those no row uses stay None)."""
    out: dict = {}
    biased = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if biased:
        rows, tokens, values = zip(*biased)
        out["bias_index"] = (_long(rows, device), _long(tokens, device))
        out["bias_values"] = torch.tensor(values, dtype=torch.float32, device=device)
    if any(p.min_p > 0 and not p.greedy for p in params):
        out["min_p"] = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    penalised = [row for row, p in enumerate(params) if p.penalised]
    if penalised:
        out["penalties"] = _penalties(params, penalised, histories or [None] * len(params), device)
    return out


def _penalties(params: list[SamplingParams], penalised: list[int], histories: Sequence[History | None],
               device: torch.device | str) -> Penalties:
    chosen = [params[row] for row in penalised]
    needs_repetition = any(p.repetition_penalty != 1 for p in chosen)
    bases: dict[tuple[int, int], int] = {}  # (id(token_ids), num_prompt_tokens) -> index in `unique`
    unique: list[History] = []
    base_of_row: list[int] = []
    draft_rows: list[int] = []
    draft_tokens: list[int] = []
    for i, row in enumerate(penalised):
        h = histories[row] or _NO_HISTORY
        key = (id(h.token_ids), h.num_prompt_tokens)
        if key not in bases:
            bases[key] = len(unique)
            unique.append(h)
        base_of_row.append(bases[key])
        draft_rows += [i] * len(h.drafts)
        draft_tokens += h.drafts
    out_rows, out_tokens = _pairs([h.token_ids[h.num_prompt_tokens:] for h in unique], base_of_row)
    output_pairs = (np.concatenate([out_rows, np.array(draft_rows, dtype=np.int64)]),
                    np.concatenate([out_tokens, np.array(draft_tokens, dtype=np.int64)]))
    prompt_pairs = _pairs([h.token_ids[:h.num_prompt_tokens] for h in unique], base_of_row) \
        if needs_repetition else None
    floats = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    on_device = lambda pairs: tuple(torch.from_numpy(a).to(device) for a in pairs)  # noqa: E731
    return Penalties(
        rows=None if len(penalised) == len(params) else _long(penalised, device),
        presence=floats([p.presence_penalty for p in chosen]),
        frequency=floats([p.frequency_penalty for p in chosen]),
        repetition=floats([p.repetition_penalty for p in chosen]),
        needs_presence_frequency=any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in chosen),
        needs_repetition=needs_repetition,
        output_pairs=on_device(output_pairs),
        prompt_pairs=None if prompt_pairs is None else on_device(prompt_pairs),
    )


_NO_HISTORY = History((), 0)


def _pairs(groups: list[Sequence[int]], group_of_row: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) int64 arrays: every token of row i's group, for each row. Each group's ints are converted
    once (numpy), then copied per row that shares it."""
    sizes = np.array([len(g) for g in groups], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=int(sizes.sum()))
    group = np.array(group_of_row, dtype=np.int64)
    row_sizes = sizes[group]
    rows = np.repeat(np.arange(len(group), dtype=np.int64), row_sizes)
    if group_of_row == list(range(len(groups))):
        return rows, flat
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    row_starts = np.cumsum(row_sizes) - row_sizes  # where each row's pairs begin
    return rows, flat[np.repeat(offsets[group] - row_starts, row_sizes) + np.arange(int(row_sizes.sum()))]


def _long(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _ban_index(banned: list[tuple[int, ...]], device: torch.device | str) -> Index | None:
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
    rank: int | None = None  # the token's rank in its row (1 = the likeliest); given for prompt logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None entries for rows that did not ask


def _apply_bans(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.ban_index is None:
        return logits
    return logits.index_put(batch.ban_index, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """logits [B, V] float32 with each penalised row's repetition, frequency and presence penalties applied
    (vLLM's rules); the other rows are returned untouched. Does not modify its input.

    Only the tokens a row's history names change, so the work is on its (row, token) pairs: gather their
    logits, penalise, scatter back. Repeated pairs write the same value. The only [B, V] passes are the copy
    and, for the frequency and presence penalties, the zeroed counts."""
    vocab, device = logits.shape[-1], logits.device
    rows, tokens = pen.output_pairs
    if pen.prompt_pairs is not None:
        rows, tokens = torch.cat([rows, pen.prompt_pairs[0]]), torch.cat([tokens, pen.prompt_pairs[1]])
    batch_rows = rows if pen.rows is None else pen.rows[rows]
    where = batch_rows * vocab + tokens  # [N] into the flattened logits
    flat = logits.reshape(-1)
    x = flat.index_select(0, where)  # [N]
    if pen.needs_repetition:  # every pair is a token of the prompt or the output
        r = pen.repetition[rows]
        x = torch.where(x > 0, x / r, x * r)
    if pen.needs_presence_frequency:
        num_rows = len(pen.presence)
        out_rows, out_tokens = pen.output_pairs
        counts = torch.zeros(num_rows * vocab, dtype=torch.int32, device=device)
        counts.scatter_add_(0, out_rows * vocab + out_tokens, torch.ones_like(out_tokens, dtype=torch.int32))
        c = counts.index_select(0, rows * vocab + tokens).float()  # [N] each pair's count in its row's output
        x = x - pen.frequency[rows] * c - pen.presence[rows] * (c > 0)
    return flat.clone().scatter_(0, where, x).view_as(logits)


def apply_grammar(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with the tokens each grammar row's bitmask forbids at -inf; other rows untouched. Does not
    modify its input."""
    return mask_logits(logits, rows, bitmask)


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits every pick starts from: the grammar masks, plus each row's logit_bias, bans to -inf, then
    the penalties. float32 once a bias or penalty applies; masks and bans alone keep the dtype (-inf is exact
    in any)."""
    if batch.grammar_rows is not None:
        logits = apply_grammar(logits, batch.grammar_rows, batch.grammar_bitmask)
    if batch.bias_index is None and batch.penalties is None:
        return _apply_bans(logits, batch)
    logits = logits.float()
    if batch.bias_index is not None:
        logits = logits.index_put(batch.bias_index, batch.bias_values, accumulate=True)
    logits = _apply_bans(logits, batch)
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def _apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p times the row's top probability."""
    probs = scaled.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [B, 1]
    return scaled.masked_fill(probs < threshold, float("-inf"))


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


def process_logits(logits: torch.Tensor, batch: SamplingBatch, dense: Dense | None = None) -> torch.Tensor:
    """Return the exact per-row distribution that ``sample`` draws from: probs [B, V] float32. `dense`: the
    backend's compiled dense_distribution (Backend.fuse), which gives the same values; None: skip what no row
    asks for."""
    logits = adjust_logits(logits.float(), batch)  # [B, V]
    if dense is not None:
        min_p = torch.zeros_like(batch.temperature) if batch.min_p is None else batch.min_p
        return dense(logits, batch.temperature, batch.greedy, min_p, batch.top_k, batch.top_p,
                     batch.needs_top_k or batch.needs_top_p)
    temperature = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # [B, V]
    if batch.min_p is not None:
        scaled = _apply_min_p(scaled, batch.min_p)
    if batch.needs_top_k or batch.needs_top_p:
        scaled = _apply_top_k_top_p(scaled, batch)
    probs = scaled.softmax(dim=-1)  # [B, V]
    if batch.any_greedy:
        one_hot = F.one_hot(row_argmax(logits), logits.shape[-1]).to(probs.dtype)  # [B, V]
        probs = torch.where(batch.greedy[:, None], one_hot, probs)
    return probs


def dense_distribution(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, min_p: torch.Tensor,
                       top_k: torch.Tensor, top_p: torch.Tensor, truncate: bool) -> torch.Tensor:
    """process_logits' dense part with every control applied to every row, the values process_logits gives:
    logits [B, V] float32 (biases, bans, penalties applied); temperature [B] (greedy rows: any), min_p [B]
    (0: off), top_k [B] (0: off), top_p [B] (1: off); `truncate`: top-k and top-p at all (the vocabulary sort).
    No branch on the values, so one compile serves every batch. Returns probs [B, V] float32."""
    vocab = logits.shape[-1]
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]  # [B, V]
    probs = scaled.softmax(dim=-1)
    scaled = scaled.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if truncate:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
        k = torch.where(top_k > 0, top_k, vocab)  # [B]
        keep = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]  # [B, V] in sorted order
        sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
        mass_before = F.pad(sorted_logits.softmax(dim=-1).cumsum(dim=-1)[:, :-1], (1, 0))
        keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
        scaled = scaled.masked_fill(~torch.empty_like(keep).scatter_(1, order, keep), float("-inf"))
    probs = scaled.softmax(dim=-1)  # [B, V]
    one_hot = torch.arange(vocab, device=logits.device)[None, :] == row_argmax(logits)[:, None]  # [B, V]
    return torch.where(greedy[:, None], one_hot.to(probs.dtype), probs)


def dense_warm_ups(vocab: int, device: torch.device | str) -> list[tuple]:
    """dense_distribution's arguments in each shape a compiler specialises (one row and several; with and
    without the sort): called once each at start-up, so no step waits for a compile."""
    calls = []
    for rows in (1, 2):
        for truncate in (False, True):
            ones = torch.ones(rows, dtype=torch.float32, device=device)
            calls.append((torch.zeros(rows, vocab, dtype=torch.float32, device=device), ones,
                          torch.zeros(rows, dtype=torch.bool, device=device), ones * 0,
                          torch.zeros(rows, dtype=torch.int64, device=device), ones, truncate))
    return calls


def warm_dense(dense: Dense, vocab: int, device: torch.device | str) -> int:
    """Call `dense` in every shape of dense_warm_ups; returns the number of calls."""
    warm_ups = dense_warm_ups(vocab, device)
    for args in warm_ups:
        dense(*args)
    return len(warm_ups)


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
    """The argmax of each row of logits [B, V] after the row's biases, bans and penalties: [B] int64."""
    return argmax(adjust_logits(logits, batch))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> list[TokenLogprobs | None]:
    """Logprobs of given tokens [B] under raw logits [B, V], for the rows of ``batch`` that asked for them."""
    return _logprobs(logits, tokens, batch) if batch.max_logprobs is not None else [None] * batch.size


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of probs [B, V] (unnormalised is fine), each row from its own generator: [B] int64."""
    noise = torch.empty_like(probs)
    for row, g in enumerate(generators):
        noise[row].exponential_(generator=g)
    return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: Argmax = row_argmax,
           dense: Dense | None = None) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, V] (any float dtype: all but a plain greedy pick run in fp32);
    logprobs come from the raw (unprocessed) logits. `argmax` makes greedy picks (row_argmax's contract);
    `dense` as process_logits takes it."""
    if batch.all_greedy and batch.max_logprobs is None:
        return SamplerOutput(token_ids=greedy_tokens(logits, batch, argmax).tolist(), logprobs=None)
    logits = logits.float()
    if batch.all_greedy:
        tokens = greedy_tokens(logits, batch, argmax)  # [B]
    else:
        tokens = _draw(process_logits(logits, batch, dense), batch)  # [B]
    logprobs = _logprobs(logits, tokens, batch) if batch.max_logprobs is not None else None
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)
