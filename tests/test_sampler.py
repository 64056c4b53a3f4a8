import math

import pytest
import torch

import engine.sampling.sampler as sampler_mod
from engine.sampling.sampler import SamplingBatch, process_logits, row_argmax, sample
from engine.sampling.sampling_params import SamplingParams

# Hand-made distribution, deliberately not sorted by id.
PROBS = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15])
LOGITS = PROBS.log()


def make_batch(params, generators=None, banned=None):
    n = len(params)
    return SamplingBatch.build(params, generators or [None] * n, banned or [()] * n, "cpu")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def support(row):
    return set(torch.nonzero(row > 0).flatten().tolist())


def test_all_greedy_is_argmax_without_softmax(monkeypatch):
    logits = torch.randn(6, 50, generator=gen(0))
    monkeypatch.setattr(sampler_mod, "process_logits", lambda *a: pytest.fail("greedy path must skip softmax"))
    batch = make_batch([SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)] * 3)
    assert batch.all_greedy
    assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_in_mixed_batch_are_argmax_and_one_hot():
    logits = torch.randn(4, 30, generator=gen(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(top_k=1, temperature=2.0), SamplingParams(top_p=0.5)]
    batch = make_batch(params, [None, gen(2), gen(3), None])
    probs = process_logits(logits, batch)
    for row in (0, 2):
        assert torch.equal(probs[row], torch.nn.functional.one_hot(logits[row].argmax(), 30).float())
    for _ in range(20):
        out = sample(logits, batch).token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_one_equals_greedy_with_seed():
    logits = torch.randn(1, 100, generator=gen(4))
    batch = make_batch([SamplingParams(top_k=1, temperature=1.0, seed=9)], [gen(9)])
    assert all(sample(logits, batch).token_ids[0] == logits.argmax() for _ in range(10))


def test_temperature_scales_logits():
    logits = torch.randn(3, 20, generator=gen(5))
    temps = [0.3, 1.0, 1.7]
    probs = process_logits(logits, make_batch([SamplingParams(temperature=t) for t in temps]))
    expected = torch.stack([(logits[i] / t).softmax(-1) for i, t in enumerate(temps)])
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("kwargs, kept", [
    ({"top_k": 2}, {1, 3}),
    ({"top_k": 4}, {1, 3, 4, 0}),
    ({"top_k": 0}, {0, 1, 2, 3, 4}),
    ({"top_p": 0.69}, {1, 3}),
    ({"top_p": 0.71}, {1, 3, 4}),
    ({"top_p": 0.3}, {1}),  # the top token is kept even though it alone exceeds p
    ({"top_p": 0.8}, {1, 3, 4}),
    ({"top_p": 0.8, "top_k": 3}, {1, 3}),  # top-p mass is measured after top-k renormalisation
])
def test_top_k_top_p_mask_exact_set(kwargs, kept):
    probs = process_logits(LOGITS[None], make_batch([SamplingParams(**kwargs)]))[0]
    assert support(probs) == kept
    expected = torch.zeros(5)
    idx = torch.tensor(sorted(kept))
    expected[idx] = PROBS[idx] / PROBS[idx].sum()
    torch.testing.assert_close(probs, expected)


def test_mixed_batch_rows_sum_to_one_and_respect_each_rows_params():
    logits = torch.randn(5, 1000, generator=gen(6)) * 3
    params = [SamplingParams(), SamplingParams(top_k=10), SamplingParams(top_p=0.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=50, top_p=0.9)]
    probs = process_logits(logits, make_batch(params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert len(support(probs[0])) == 1000
    assert len(support(probs[1])) == 10
    assert support(probs[1]) == set(logits[1].topk(10).indices.tolist())
    assert len(support(probs[3])) == 1
    assert len(support(probs[4])) <= 50


def test_bans_are_respected():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=2)]
    banned = [(1,), (0, 3), (2,)]
    batch = make_batch(params, [None, gen(1), None], banned)
    probs = process_logits(logits, batch)
    assert probs[0, 1] == 0 and probs[0, 2] == 1
    assert probs[1, 0] == 0 and probs[1, 3] == 0 and probs[2, 2] == 0
    for _ in range(200):
        out = sample(logits, batch).token_ids
        assert out[0] == 2 and out[1] in (1, 2) and out[2] in (3, 0, 1)
    greedy = make_batch([SamplingParams(temperature=0.0)], banned=[(1, 2)])
    assert sample(logits[:1], greedy).token_ids == [3]


def test_seeded_row_is_independent_of_batch_composition():
    steps, vocab = 25, 300
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=1234)
    logits = [torch.randn(8, vocab, generator=gen(100 + s)) * 2 for s in range(steps)]
    alone_gen = gen(1234)
    alone = [sample(l[3:4], make_batch([target], [alone_gen])).token_ids[0] for l in logits]

    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=7),
              SamplingParams(top_p=0.3), SamplingParams(temperature=1.9), SamplingParams(top_k=1),
              SamplingParams(temperature=0.2, seed=8)]
    params = others[:3] + [target] + others[3:]
    gens = [None, None, gen(7), gen(1234), None, None, None, gen(8)]
    batched = []
    for step, l in enumerate(logits):
        torch.manual_seed(step)  # perturb the shared RNG used by unseeded rows
        batched.append(sample(l, make_batch(params, gens)).token_ids[3])
    assert batched == alone
    assert len(set(alone)) > 1  # really sampled, not degenerate


def chi_square(tokens, expected_probs):
    counts = torch.bincount(tokens, minlength=len(expected_probs)).double()
    mask = expected_probs > 0
    assert counts[~mask].sum() == 0, "sampled a token with zero probability"
    expected = expected_probs[mask].double() * len(tokens)
    return float(((counts[mask] - expected) ** 2 / expected).sum()), int(mask.sum()) - 1


# 99.9% quantiles of chi-square by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_distribution(seeded):
    n = 20_000
    params = SamplingParams(temperature=0.7, top_p=0.9)
    scaled = (LOGITS / 0.7).softmax(-1)
    theory = scaled.clone()
    theory[[0, 2]] = 0  # after T=0.7 the mass sorted before token 0 is 0.91 >= 0.9: tokens 0 and 2 fall outside
    theory /= theory.sum()
    batch = make_batch([params] * n, [gen(10_000 + i) for i in range(n)] if seeded else None)
    probs = process_logits(LOGITS.expand(n, 5), batch)
    torch.testing.assert_close(probs[0], theory)
    torch.manual_seed(0)
    tokens = torch.tensor(sample(LOGITS.expand(n, 5), batch).token_ids)
    stat, dof = chi_square(tokens, theory)
    assert stat < CHI2_999[dof], (stat, torch.bincount(tokens, minlength=5))


def test_logprobs_from_raw_logits():
    logits = torch.randn(3, 40, generator=gen(11)) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5), SamplingParams(),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = sample(logits, make_batch(params, [gen(1), None, None]))
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, raw[0, out.token_ids[0]].item(), rel_tol=1e-6)
    ids = [i for i, _ in first.top]
    vals = [v for _, v in first.top]
    assert ids == raw[0].topk(5).indices.tolist()
    assert vals == sorted(vals, reverse=True)
    torch.testing.assert_close(torch.tensor(vals), raw[0, ids])
    assert third.top == [] and math.isclose(third.logprob, raw[2].max().item(), rel_tol=1e-6)


def test_logprobs_greedy_fast_path_and_absent_when_unrequested():
    logits = torch.randn(2, 10, generator=gen(12))
    out = sample(logits, make_batch([SamplingParams(temperature=0.0, logprobs=2)] * 2))
    assert [lp.top[0][0] for lp in out.logprobs] == out.token_ids
    assert sample(logits, make_batch([SamplingParams()] * 2)).logprobs is None


def test_batch_flags():
    b = make_batch([SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=1, logprobs=3),
                    SamplingParams(logprobs=7)])
    assert not b.all_greedy and not b.needs_top_k and not b.needs_top_p and b.max_logprobs == 7
    b = make_batch([SamplingParams(top_k=4), SamplingParams(top_p=0.9)])
    assert b.needs_top_k and b.needs_top_p and b.max_logprobs is None
    assert b.top_k.tolist() == [4, 0] and b.temperature.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_seeded_rows_are_batch_invariant():
    logits = torch.randn(4, 5000, generator=gen(13)) * 2
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=5), SamplingParams(),
              SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, logprobs=3)]
    cpu = process_logits(logits, make_batch(params))
    cuda_batch = SamplingBatch.build(params, [torch.Generator("cuda").manual_seed(5), None, None, None],
                                     [()] * 4, "cuda")
    torch.testing.assert_close(process_logits(logits.cuda(), cuda_batch).cpu(), cpu, atol=1e-5, rtol=1e-4)
    batched = [sample(logits.cuda(), cuda_batch).token_ids[0] for _ in range(10)]
    solo_batch = SamplingBatch.build(params[:1], [torch.Generator("cuda").manual_seed(5)], [()], "cuda")
    assert [sample(logits[:1].cuda(), solo_batch).token_ids[0] for _ in range(10)] == batched


def test_row_argmax_answers_as_argmax_on_ties_nan_and_inf():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (16, 3000), generator=gen).float()  # many tied maxima per row
    x[3, 100] = float("nan")  # NaN wins, the first NaN when there are several
    x[5, 7] = x[5, 2000] = float("nan")
    x[7] = -float("inf")
    x[8, 2999] = float("inf")
    want = x.argmax(dim=-1)
    assert want[5] == 7 and want[7] == 0 and want[8] == 2999
    assert torch.equal(row_argmax(x), want)
