"""The sampling controls (presence, frequency and repetition penalties, logit_bias, min_p): the batched sampler
against a plain-Python reference on random logits and histories, mixed batches, verified draft positions,
validation, the wire and the request parser."""
from __future__ import annotations

import random

import pytest
import torch

import engine.sampling.sampler as sampler_mod
from actors.convert import params_from_wire, params_to_wire
from engine.core.runner import _histories, _verify_histories
from engine.sampling.sampler import History, SamplingBatch, dense_distribution, process_logits, sample
from engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from engine.core.step import ScheduledChunk, build_chunk
from server.errors import ApiError
from server.protocol import ModelLimits, parse_chat, parse_completion, sampling_params
from tests.sampling_reference import adjusted_logits, distribution
from transport import codec
from transport import messages as m

VOCAB = 13
LIMITS = ModelLimits("m", 1024, 512)


def random_history(rng: random.Random, vocab: int = VOCAB) -> History:
    """A prompt and an output drawn from a few tokens, so that repeats (and tokens in both) are common."""
    pool = rng.sample(range(vocab), 6)
    prompt = [rng.choice(pool) for _ in range(rng.randrange(1, 8))]
    output = [rng.choice(pool) for _ in range(rng.randrange(0, 10))]
    return History(prompt + output, len(prompt))


CONTROLS = {
    "presence": lambda rng: dict(presence_penalty=rng.uniform(-2, 2)),
    "frequency": lambda rng: dict(frequency_penalty=rng.uniform(-2, 2)),
    "repetition": lambda rng: dict(repetition_penalty=rng.choice([rng.uniform(0.3, 1), rng.uniform(1, 3)])),
    "logit_bias": lambda rng: dict(logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(VOCAB), 3)}),
    "min_p": lambda rng: dict(min_p=rng.uniform(0.01, 0.5)),
}


def combined(rng: random.Random) -> dict:
    return {k: v for make in CONTROLS.values() for k, v in make(rng).items()}


def random_params(rng: random.Random, controls: dict, greedy: bool) -> SamplingParams:
    shape = dict(temperature=0.0) if greedy else dict(temperature=rng.uniform(0.3, 1.7),
                                                     top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.8]))
    return SamplingParams(**shape, **controls)


def reference(logits: torch.Tensor, params: list[SamplingParams], histories: list[History | None]) -> torch.Tensor:
    rows = []
    for row, p, h in zip(logits.tolist(), params, histories):
        h = h or History((), 0)
        output = list(h.token_ids[h.num_prompt_tokens:]) + list(h.drafts)
        rows.append(distribution(row, p, h.token_ids[:h.num_prompt_tokens], output))
    return torch.tensor(rows, dtype=torch.float64)


def batch_of(params, histories, banned=None):
    n = len(params)
    return SamplingBatch.build(params, [None] * n, banned or [()] * n, "cpu", histories)


@pytest.mark.parametrize("control", [*CONTROLS, "combined"])
@pytest.mark.parametrize("seed", range(4))
def test_batched_distribution_matches_the_reference(control, seed):
    rng = random.Random(seed)
    make = combined if control == "combined" else CONTROLS[control]
    params = [random_params(rng, make(rng), greedy=i % 4 == 3) for i in range(12)]
    histories = [random_history(rng) for _ in params]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    probs = process_logits(logits, batch_of(params, histories))
    torch.testing.assert_close(probs.double(), reference(logits, params, histories), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("control", [*CONTROLS, "combined", "none"])
@pytest.mark.parametrize("seed", range(3))
def test_the_branch_free_distribution_gives_the_branching_ones_values(control, seed):
    """dense_distribution (what a GPU backend compiles) applies every control to every row, neutral where a
    row does not ask: the same probabilities, bit for bit, as the path that skips them; with and without the
    vocabulary sort (top-k/top-p asked by no row), with and without greedy rows."""
    rng = random.Random(100 + seed)
    make = combined if control == "combined" else CONTROLS.get(control, lambda rng: {})
    truncating = [random_params(rng, make(rng), greedy=i % 4 == 3) for i in range(12)]
    plain = [SamplingParams(temperature=rng.uniform(0.3, 1.7), **make(rng)) for _ in range(5)]
    for params in (truncating, plain, plain + [SamplingParams(temperature=0.0)]):
        histories = [random_history(rng) for _ in params]
        batch = batch_of(params, histories)
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
        assert torch.equal(process_logits(logits, batch, dense_distribution), process_logits(logits, batch))
    assert not batch.needs_top_k and not batch.needs_top_p and batch.any_greedy


@pytest.mark.parametrize("seed", range(4))
def test_penalties_move_logits_as_the_reference_says(seed):
    rng = random.Random(100 + seed)
    params = [SamplingParams(temperature=0.0, **combined(rng)) for _ in range(8)]
    histories = [random_history(rng) for _ in params]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    ours = sampler_mod.adjust_logits(logits, batch_of(params, histories))
    for row, p, h in zip(range(len(params)), params, histories):
        ref = adjusted_logits(logits[row].tolist(), p, h.token_ids[:h.num_prompt_tokens],
                              h.token_ids[h.num_prompt_tokens:])
        torch.testing.assert_close(ours[row].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-4, rtol=1e-5)


def test_greedy_picks_follow_the_penalties():
    rng = random.Random(7)
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0)] * 16
    histories = [random_history(rng) for _ in params]
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(7))
    picks = sample(logits, batch_of(params, histories)).token_ids
    expected = reference(logits, params, histories).argmax(-1).tolist()
    assert picks == expected
    assert picks != logits.argmax(-1).tolist()  # the penalties changed some pick


def test_rows_without_controls_are_untouched_in_a_mixed_batch():
    rng = random.Random(3)
    plain = [SamplingParams(temperature=rng.uniform(0.5, 1.5), top_p=0.9) for _ in range(6)]
    controlled = [random_params(rng, combined(rng), greedy=False) for _ in range(6)]
    mixed = [p for pair in zip(plain, controlled) for p in pair]
    histories = [None if i % 2 == 0 else random_history(rng) for i in range(12)]
    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    probs = process_logits(logits, batch_of(mixed, histories))
    alone = process_logits(logits[0::2], batch_of(plain, None))
    assert torch.equal(probs[0::2], alone)  # bit for bit
    torch.testing.assert_close(probs[1::2].double(), reference(logits[1::2], controlled, histories[1::2]),
                               atol=2e-6, rtol=1e-5)
    assert not torch.allclose(probs[1::2], process_logits(logits[1::2], batch_of(plain, None)))


def test_a_batch_without_controls_builds_and_runs_none_of_them(monkeypatch):
    def fail(*args):
        raise AssertionError("a batch without penalties must not count tokens")

    monkeypatch.setattr(sampler_mod, "apply_penalties", fail)
    monkeypatch.setattr(sampler_mod, "_apply_min_p", fail)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(top_k=3)]
    history = History((1, 2, 3), 1)
    batch = batch_of(params, [history] * 3)
    assert batch.penalties is None and batch.bias_index is None and batch.min_p is None
    sample(torch.randn(3, VOCAB), batch)
    # min_p on a greedy row changes nothing, so it builds nothing either
    assert batch_of([SamplingParams(temperature=0.0, min_p=0.5)], None).min_p is None


def test_only_penalised_rows_are_counted():
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(logit_bias={2: 5.0})]
    batch = batch_of(params, [History((4, 4), 0), History((5, 6), 1), History((7,), 0)])
    pen = batch.penalties
    assert pen.rows.tolist() == [1]
    assert [t.tolist() for t in pen.output_pairs] == [[0], [6]]
    assert pen.prompt_pairs is None  # no repetition penalty, no prompt


def test_logit_bias_plus_100_forces_and_minus_100_bans():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    forced, banned = 5, int(logits[1].argmax())
    params = [SamplingParams(temperature=1.0, logit_bias={forced: 100}),
              SamplingParams(temperature=1.0, logit_bias={banned: -100})]
    batch = SamplingBatch.build(params, [torch.Generator().manual_seed(i) for i in range(2)], [(), ()], "cpu")
    draws = [sample(logits, batch).token_ids for _ in range(200)]
    assert all(d[0] == forced for d in draws)
    assert all(d[1] != banned for d in draws)
    greedy = [SamplingParams(temperature=0.0, logit_bias={forced: 100})]
    assert sample(logits[:1], batch_of(greedy, None)).token_ids == [forced]


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    probs = torch.tensor([0.40, 0.05, 0.20, 0.07, 0.28])
    params = [SamplingParams(min_p=0.15), SamplingParams(min_p=0.6), SamplingParams(min_p=1.0)]
    out = process_logits(probs.log().repeat(3, 1), batch_of(params, None))
    assert (out[0] > 0).tolist() == [True, False, True, True, True]  # 0.15 * 0.40 = 0.06
    assert (out[1] > 0).tolist() == [True, False, False, False, True]  # 0.24
    assert (out[2] > 0).tolist() == [True, False, False, False, False]
    torch.testing.assert_close(out[1], torch.tensor([0.40, 0, 0, 0, 0.28]) / 0.68)


def _verified_chunk(seq_id: int, params: SamplingParams, history: History, drafts: tuple[int, ...]):
    return ScheduledChunk(seq_id, (history.token_ids[-1], *drafts), len(history.token_ids) - 1, (0,), True, params,
                          None, num_draft=len(drafts), history=tuple(history.token_ids),
                          num_prompt_tokens=history.num_prompt_tokens)


def test_each_verified_position_counts_the_drafts_before_it():
    """The rows of a verified chunk share its history; row j must count the j drafts before it, exactly as a
    batch built with those drafts appended to each output does (chunks of several histories, one unpenalised)."""
    rng = random.Random(11)
    params = SamplingParams(temperature=0.9, presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3)
    other = SamplingParams(temperature=0.5, frequency_penalty=-1.0, repetition_penalty=0.8)
    chunks = [_verified_chunk(0, params, random_history(rng), (4, 3, 4, 9)),
              _verified_chunk(1, SamplingParams(temperature=0.7), random_history(rng), (1, 2)),
              _verified_chunk(2, other, random_history(rng), (7, 7, 0))]
    rows = _verify_histories(chunks)
    assert len(rows) == 5 + 3 + 4 and rows[5:8] == [None] * 3
    assert [tuple(h.drafts) for h in rows[:5]] == [(), (4,), (4, 3), (4, 3, 4), (4, 3, 4, 9)]
    row_params = [c.params for c in chunks for _ in range(c.num_draft + 1)]
    spelled = [None if h is None else History(tuple(h.token_ids) + tuple(h.drafts), h.num_prompt_tokens)
               for h in rows]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    shared = process_logits(logits, batch_of(row_params, rows))
    torch.testing.assert_close(shared, process_logits(logits, batch_of(row_params, spelled)))
    torch.testing.assert_close(shared.double(), reference(logits, row_params, spelled), atol=2e-6, rtol=1e-5)


def test_chunks_carry_their_history_only_when_penalised_and_sampling():
    penalised = SamplingParams(frequency_penalty=1.0)
    tokens = [9, 8, 7, 6, 5]
    last = build_chunk(1, tokens, 4, 1, [0], penalised, 0, 3, frozenset())
    assert last.history == (9, 8, 7, 6, 5) and last.num_prompt_tokens == 3
    assert build_chunk(1, tokens, 0, 2, [0], penalised, 0, 3, frozenset()).history == ()  # a prefill chunk
    assert build_chunk(1, tokens, 4, 1, [0], SamplingParams(), 0, 3, frozenset()).history == ()
    assert _histories([build_chunk(1, tokens, 4, 1, [0], SamplingParams(), 0, 3, frozenset())]) is None
    (h,) = _histories([last])
    assert (tuple(h.token_ids), h.num_prompt_tokens) == ((9, 8, 7, 6, 5), 3)


# ---------------------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: -101}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
])
def test_invalid_controls_name_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": -2}, {"presence_penalty": 2}, {"frequency_penalty": -2.0}, {"frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3}, {"repetition_penalty": 10}, {"min_p": 0}, {"min_p": 1},
    {"logit_bias": {0: -100, 7: 100}},
])
def test_boundary_controls_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == (tuple(sorted(value.items())) if name == "logit_bias" else value)


def test_logit_bias_is_normalised_and_hashable():
    a = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert a.logit_bias == ((2, -3.5), (9, 1.0))
    assert a == SamplingParams(logit_bias=[(2, -3.5), (9, 1.0)])
    assert hash(a) == hash(SamplingParams(logit_bias=a.logit_bias))
    assert SamplingParams(logit_bias=None).logit_bias == ()
    assert a.adjusts_logits and not a.penalised
    assert SamplingParams(repetition_penalty=1.2).penalised and not SamplingParams().adjusts_logits


def test_controls_cross_the_wire():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.3, min_p=0.05,
                            logit_bias={17: -100, 3: 2.5}, stop=["x"], seed=4)
    msg = m.AddRequest("r", [1, 2, 3], params_to_wire(params))
    decoded = codec.decode(codec.encode(msg))
    assert params_from_wire(decoded.sampling) == params


# ---------------------------------------------------------------------------------------- requests

def _params(body: dict, chat: bool = False) -> SamplingParams:
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, "m") if chat else \
        parse_completion({"prompt": "hi", **body}, "m")
    return sampling_params(req.sampling, 3, LIMITS)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_requests_carry_the_controls(chat):
    params = _params({"presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1,
                      "logit_bias": {"5": 100, "7": -100}}, chat)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == \
        (1.0, -0.5, 1.2, 0.1)
    assert params.logit_bias == ((5, 100.0), (7, -100.0))
    assert _params({}, chat) == _params({"presence_penalty": None, "logit_bias": None, "min_p": None}, chat)


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.01}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # outside the vocabulary of 512
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"logit_bias": [5, 1]}, "logit_bias"),
])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_controls_are_400_naming_the_field(body, param, chat):
    with pytest.raises(ApiError) as info:
        _params(body, chat)
    assert info.value.status == 400 and info.value.param == param
