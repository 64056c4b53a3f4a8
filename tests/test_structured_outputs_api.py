"""Structured outputs through the real server with the official openai client, in actor mode (a prefill
actor samples the first token, the decode actor the rest, each compiling the constraint itself)."""
from __future__ import annotations

import json
import re

import openai
import pytest

from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("structured") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--prefill-actors", "1",
                        "--decode-actors", "1", "--disagg", "always")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def check(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "rank"} and isinstance(value["city"], str) and len(value["city"]) <= 8
    assert type(value["rank"]) is int and 1 <= value["rank"] <= 9


def test_chat_with_a_json_schema_returns_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}],
                                           max_tokens=60, temperature=0.8, seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        check(r.choices[0].message.content)


def test_streamed_json_schema_is_valid_too(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}],
                                            max_tokens=60, temperature=0, response_format=fmt, stream=True)
    check("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def test_vllm_guided_fields_on_completions(client):
    for seed in range(4):  # n > 1 is covered in the engine tests
        r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": r"[A-Z]{2}[0-9]{2}"})
        assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, response_format=fmt)
    assert err.value.body["param"] == "response_format"
    assert "nonsense" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body={"guided_regex": "[a-"})
    assert err.value.body["param"] == "guided_regex"
