"""The sampling controls over HTTP with the official openai client: the real `cli.py serve` on the tiny model,
in-process and on a prefill + decode actor pair, against the embedded engine's output for the same params."""
from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer as HfTokenizer

from engine import LLM, SamplingParams
from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server

MODEL = "tiny-test"
PROMPT = [17, 230, 45, 99, 301, 12, 77, 5, 260]
GREEDY = dict(max_tokens=24, temperature=0.0)
PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.9)
EXTRA = dict(repetition_penalty=1.4, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("controls") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _tokens(llm, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(**params))[0].outputs[0].token_ids


def _repeats(items) -> int:
    return len(items) - len(set(items))


def test_penalties_match_the_embedded_engine_and_cut_repeats(client, llm, tokenizer):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, **GREEDY,
                                      extra_body={"ignore_eos": True}).choices[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, **GREEDY, **PENALTIES,
                                    extra_body=EXTRA).choices[0]
    expected = _tokens(llm, **GREEDY, **PENALTIES, **EXTRA)
    assert out.text == tokenizer.decode(expected)
    assert _repeats(expected) < _repeats(_tokens(llm, **GREEDY, ignore_eos=True))
    assert _repeats(out.logprobs.tokens) < _repeats(plain.logprobs.tokens)


def test_a_large_frequency_penalty_on_chat(client):
    messages = [{"role": "user", "content": "Say something"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, max_tokens=32,
                                           temperature=0, extra_body={"ignore_eos": True})
    penalised = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, max_tokens=32,
                                               temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                                               extra_body={"ignore_eos": True})
    tokens = lambda r: [t.token for t in r.choices[0].logprobs.content]  # noqa: E731
    assert _repeats(tokens(plain)) > 5
    assert _repeats(tokens(penalised)) < _repeats(tokens(plain)) // 2


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logit_bias_plus_100_forces_a_token(client, tokenizer, route):
    bias = {"123": 100}
    if route == "chat":
        text = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=1.0, logit_bias=bias,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
    else:
        text = client.completions.create(model=MODEL, prompt="hi", max_tokens=6, temperature=1.0, logit_bias=bias,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert text == tokenizer.decode([123] * 6)


def test_logit_bias_minus_100_bans_a_token(client, llm, tokenizer):
    plain = _tokens(llm, **GREEDY, ignore_eos=True)
    favourite = max(set(plain), key=plain.count)
    out = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, logit_bias={str(favourite): -100},
                                    extra_body={"ignore_eos": True}).choices[0].text
    expected = _tokens(llm, **GREEDY, ignore_eos=True, logit_bias={favourite: -100})
    assert favourite not in expected and out == tokenizer.decode(expected)


def test_min_p_of_one_samples_the_greedy_output(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True})
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=3,
                                        extra_body={"ignore_eos": True, "min_p": 1.0})
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=3,
                                     extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == greedy.choices[0].text != free.choices[0].text


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"token": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_out_of_range_controls_are_400_naming_the_field(server, route, body, param):
    base = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    result = server.post(route, {**base, **body})
    assert result.status == 400, result.body
    error = result.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_the_openai_client_sees_the_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", presence_penalty=3.0)
    assert info.value.status_code == 400 and info.value.body["param"] == "presence_penalty"


@pytest.fixture(scope="module")
def actor_server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("controls-actors") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--prefill-actors", "1",
                        "--decode-actors", "1", "--disagg", "always")
    yield proc
    assert proc.stop() == 0, proc.log()


def test_the_controls_reach_the_actors(actor_server, llm, tokenizer):
    """The prefill actor samples the first token (repetition penalty on the prompt, the bias), the decode actor
    the rest: both must apply what the request asked for."""
    client = openai.OpenAI(base_url=actor_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    bias = {PROMPT[0]: 3.0, 40: -2.0}
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, **GREEDY, **PENALTIES, logit_bias={str(k): v for k, v in bias.items()},
        extra_body=EXTRA)
    assert raw.headers["X-Placement"].startswith("disaggregated")
    expected = _tokens(llm, **GREEDY, **PENALTIES, **EXTRA, logit_bias=bias)
    assert raw.parse().choices[0].text == tokenizer.decode(expected)
    assert expected != _tokens(llm, **GREEDY, ignore_eos=True)
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0,
                                       logit_bias={"123": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([123] * 5)
