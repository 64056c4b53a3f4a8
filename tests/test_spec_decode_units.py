"""Speculative decoding pieces on their own: the acceptance rule's output distribution (chi-square), the
runner's verification path on a stub model, adaptive K, prompt lookup, configuration."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from commands.args import add_engine_args, engine_options
from engine.config import ConfigError, EngineConfig
from engine.core.runner import ModelRunner
from engine.sampling.sampling_params import SamplingParams
from engine.speculative.acceptance import verify_drafts, verify_greedy
from engine.speculative.adaptive import MAX_PAUSE, SpecState, adapt
from engine.speculative.ngram import NgramProposer
from engine.core.step import ScheduledChunk, SchedulerOutput

K, V = 3, 6
CHI2_CRITICAL_DF5 = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
# Target distributions per output position (zeros as top-k/top-p would leave) and deliberately different drafts,
# including draft mass on tokens the target forbids.
pytestmark = pytest.mark.usefixtures("one_thread")
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.05, 0.40, 0.30, 0.00, 0.20],
                  [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
                  [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])  # [K + 2, V]
Q = torch.tensor([[0.10, 0.40, 0.05, 0.15, 0.10, 0.20],
                  [0.30, 0.00, 0.30, 0.10, 0.20, 0.10],
                  [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],
                  [1 / 6] * 6])  # [K + 1, V]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed tokens against probs [V], over the categories with non-zero mass."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "a token with zero target probability was emitted"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, n, replacement=True, generator=gen)


def speculative_round(first: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences at output position `first`: drafts from Q[first:], verified against P[first:]."""
    drafts = torch.stack([draw(Q[first + j], n, gen) for j in range(K)], dim=1)  # [n, K]
    verdict = verify_drafts(P[first:first + K + 1].expand(n, K + 1, V), drafts, Q[first:first + K].expand(n, K, V),
                            torch.full((n,), K), torch.rand(n, K, generator=gen),
                            torch.empty(n, V).exponential_(generator=gen))
    return verdict.tokens, verdict.num_accepted


def test_speculative_sampling_preserves_the_target_distribution():
    n, gen = 100_000, torch.Generator().manual_seed(2024)
    tokens, accepted = speculative_round(0, n, gen)
    redo = accepted == 0  # these emitted one token only; their next one comes from the next round
    second = tokens[:, 1].clone()
    next_tokens, _ = speculative_round(1, int(redo.sum()), gen)
    second[redo] = next_tokens[:, 0]
    assert chi_square(tokens[:, 0], P[0]) < CHI2_CRITICAL_DF5
    assert chi_square(second, P[1]) < CHI2_CRITICAL_DF5
    third = tokens[accepted >= 2, 2]  # given two accepted drafts, the third token is again a fresh position
    assert chi_square(third, P[2]) < CHI2_CRITICAL_DF5
    # The test has the power to see a 5% bias: 5% of token 0's mass moved to token 1 is rejected.
    biased = P[0].clone()
    biased[0], biased[1] = biased[0] * 0.95, biased[1] + biased[0] * 0.05
    assert chi_square(tokens[:, 0], biased) > CHI2_CRITICAL_DF5


def test_a_naive_rule_fails_the_same_test():
    """Resampling from p instead of max(0, p - q) after a rejection is biased; the chi-square sees it."""
    n, gen = 100_000, torch.Generator().manual_seed(7)
    drafts = draw(Q[0], n, gen)
    accept = torch.rand(n, generator=gen) < (P[0][drafts] / Q[0][drafts]).clamp(max=1)
    naive = torch.where(accept, drafts, draw(P[0], n, gen))
    assert chi_square(naive, P[0]) > 10 * CHI2_CRITICAL_DF5


def test_greedy_acceptance_is_the_longest_matching_prefix_plus_the_argmax():
    target = torch.nn.functional.one_hot(torch.tensor([[2, 4, 1, 5], [3, 3, 3, 0], [1, 2, 3, 4]]), V).float()
    drafts = torch.tensor([[2, 4, 0], [3, 3, 3], [0, 2, 3]])
    verdict = verify_drafts(target, drafts, None, torch.tensor([3, 2, 3]), torch.zeros(3, K), torch.ones(3, V))
    assert verdict.num_accepted.tolist() == [2, 2, 0]
    emitted = [row[:a + 1] for row, a in zip(verdict.tokens.tolist(), verdict.num_accepted.tolist())]
    assert emitted == [[2, 4, 1], [3, 3, 3], [1]]  # row 1 used only 2 of its drafts: bonus from position 2


def test_the_greedy_fast_path_agrees_with_the_general_rule():
    gen = torch.Generator().manual_seed(3)
    n, k = 500, 4
    argmax = torch.randint(0, 3, (n, k + 1), generator=gen)  # a small range so that drafts often match
    drafts = torch.randint(0, 3, (n, k), generator=gen)
    num_drafts = torch.randint(0, k + 1, (n,), generator=gen)
    general = verify_drafts(torch.nn.functional.one_hot(argmax, V).float(), drafts, None, num_drafts,
                            torch.zeros(n, k), torch.ones(n, V))
    fast = verify_greedy(argmax, drafts, num_drafts)
    assert torch.equal(general.num_accepted, fast.num_accepted)
    emitted = lambda v: [r[:a + 1] for r, a in zip(v.tokens.tolist(), v.num_accepted.tolist())]  # noqa: E731
    assert emitted(general) == emitted(fast)
    assert 0 < fast.num_accepted.float().mean() < k


class StubModel:
    """Logits depend only on the position: row j of a chunk starting at 0 scores log P[j]."""

    def __call__(self, input_ids, positions, meta, kv_caches, keep_rows=None, layer_metas=None):
        hidden = positions[:, None].float()  # [T, 1]
        return hidden if keep_rows is None else hidden[keep_rows]

    def compute_logits(self, hidden):
        return P.log()[hidden[:, 0].long()]  # [R, V]


def test_runner_verification_samples_the_target_distribution():
    """The runner's path (processed p per row, draft q per row, per-sequence randomness) on 20k chunks."""
    n, gen = 20_000, torch.Generator().manual_seed(11)
    drafts = torch.stack([draw(Q[j], n, gen) for j in range(K)], dim=1).tolist()  # [n, K]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    chunks = tuple(ScheduledChunk(i, (0, *d), 0, (0,), True, params, None, num_draft=K, draft_probs=Q[:K])
                   for i, d in enumerate(drafts))
    runner = ModelRunner(StubModel(), SimpleNamespace(block_size=16, layers=[]))
    torch.manual_seed(5)
    out = runner.run(SchedulerOutput(chunks=chunks)).verified_token_ids
    emitted = [out[i] for i in range(n)]
    assert chi_square(torch.tensor([e[0] for e in emitted]), P[0]) < CHI2_CRITICAL_DF5
    assert chi_square(torch.tensor([e[1] for e in emitted if len(e) > 1]), P[1]) < CHI2_CRITICAL_DF5
    accepted = sum(len(e) - 1 for e in emitted) / n
    expected_first = float(torch.minimum(P[0], Q[0]).sum())  # P(accept d_1) = sum_x min(p, q)
    assert accepted > expected_first > 0.5


def test_adaptive_k_shrinks_pauses_probes_and_grows_back():
    state = SpecState.start(4)
    for _ in range(20):
        state = adapt(state, state.k, 0)
        if state.k == 0:
            break
    assert state.k == 0 and state.pause > 0
    first_pause = state.pause
    while state.pause:
        state = adapt(state, 0, 0)
    assert state.k == 1  # probing again
    while state.k:
        state = adapt(state, state.k, 0)
    assert state.pause == min(2 * first_pause, MAX_PAUSE)  # failing again pauses longer
    while state.pause:
        state = adapt(state, 0, 0)
    for _ in range(20):
        state = adapt(state, state.k, state.k)
    assert state.k == 4  # never above the configured maximum
    assert adapt(state, 0, 0) == state  # a step without proposals teaches nothing


def test_ngram_lookup_takes_the_most_recent_longest_match():
    lookup = NgramProposer().lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]  # latest occurrence of [1, 2, 3]
    assert lookup([4, 5, 6, 1, 2, 4, 5], 2) == [6, 1]  # 2-gram
    assert lookup([7, 1, 8, 1], 4) == [8, 1]  # 1-gram, shortened at the end of the sequence
    assert lookup([1, 2, 3, 4], 3) == []
    assert lookup([1, 2, 1, 2], 0) == []


def test_speculative_configuration_is_validated():
    assert EngineConfig(speculative="draft", draft_model="self:3").num_speculative_tokens == 4
    for bad in [dict(speculative="medusa"), dict(speculative="draft"), dict(draft_model="self:2"),
                dict(speculative="draft", draft_model="self:0"), dict(speculative="draft", draft_model="self:x"),
                dict(speculative="ngram", num_speculative_tokens=0),
                dict(speculative="ngram", num_speculative_tokens=17)]:
        with pytest.raises(ConfigError):
            EngineConfig(**bad)


def test_flags_map_onto_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "self:8", "--num-speculative-tokens", "6"])
    config = EngineConfig(**engine_options(args))
    assert (config.speculative, config.draft_model, config.num_speculative_tokens) == ("draft", "self:8", 6)
    assert EngineConfig(**engine_options(parser.parse_args([]))).speculative == "off"
