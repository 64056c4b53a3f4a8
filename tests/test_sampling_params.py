import dataclasses

import pytest

from engine.sampling.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 0, 1.0, 1.0, -1)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.greedy


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 1.5}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"seed": "abc"}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
])
def test_invalid_values_name_the_param(kwargs, param):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    assert param in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"n": 128}, {"max_tokens": None, "min_tokens": 1000}, {"min_tokens": 16}, {"temperature": 0.0},
    {"temperature": 2.0}, {"top_p": 1e-6}, {"top_k": 0}, {"top_k": 1}, {"logprobs": 0}, {"logprobs": 20},
    {"seed": 0}, {"truncate_prompt_tokens": 1}, {"truncate_prompt_tokens": -1},
])
def test_boundary_values_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_stop_normalised_to_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"temperature": 0.5, "top_k": 2}, False),
    ({"top_k": 0}, False),
])
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_frozen_and_with_seed_copies():
    p = SamplingParams(temperature=0.7, stop=["x"])
    q = p.with_seed(42)
    assert q.seed == 42 and p.seed is None
    assert dataclasses.replace(q, seed=None) == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 3  # type: ignore[misc]


def test_truncated_prompt_keeps_the_last_tokens():
    ids = list(range(10))
    assert SamplingParams().truncated_prompt(ids, 4) == ids
    assert SamplingParams(truncate_prompt_tokens=3).truncated_prompt(ids, 100) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=1).truncated_prompt(tuple(ids), 100) == [9]
    assert SamplingParams(truncate_prompt_tokens=30).truncated_prompt(ids, 100) == ids
    assert SamplingParams(truncate_prompt_tokens=-1).truncated_prompt(ids, 4) == [6, 7, 8, 9]
