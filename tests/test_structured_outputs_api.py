"""Structured outputs through the real server with the official openai client, in actor mode (a prefill
actor samples the first token, the decode actor the rest, each compiling the constraint itself). A
constraint the grammar engine refuses is refused by the engine wherever it runs, with the same answer."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from client import LLM, AsyncLLM
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.structured import Guide
from server.app import create_app
from server.settings import ServerSettings
from tests.server_utils import TINY_ENGINE_FLAGS, http, openai_client, start_server

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


NONSENSE = {"type": "nonsense"}
UNCOMPILABLE = [  # (route, body, the field the refusal names)
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": NONSENSE}}},
     "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "guided_regex": "[a-"}, "guided_regex"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": NONSENSE}}],
                              "tool_choice": "required"}, "tools"),
]
ENGINE = dict(dtype="float32", num_kv_blocks=256, block_size=8, num_threads=1)


async def _in_process_answers(model_dir: str) -> list[tuple[int, dict]]:
    """The UNCOMPILABLE requests' answers from a server whose engine runs in its own process."""
    llm = AsyncLLM(model_dir, **ENGINE)
    try:
        app = create_app(llm, ServerSettings(served_model_name=MODEL))
        async with TestServer(app) as test_server, aiohttp.ClientSession() as session:
            answers = []
            for route, body, _ in UNCOMPILABLE:
                async with session.post(test_server.make_url(route), json=body) as resp:
                    answers.append((resp.status, await resp.json()))
            return answers
    finally:
        llm.shutdown()


def test_an_uncompilable_constraint_is_the_same_400_in_process_and_from_the_actors(server, tiny_model_dir):
    """The main process does not compile constraints: the engine refuses them where it runs, and the client
    gets the same answer whether that is this process or a prefill and a decode actor."""
    local = asyncio.run(_in_process_answers(str(tiny_model_dir)))
    for (route, body, param), (status, answer) in zip(UNCOMPILABLE, local):
        remote = http("POST", server.url + route, body)
        assert (remote.status, remote.json()) == (status, answer)
        assert status == 400 and answer["error"]["param"] == param
        assert answer["error"]["message"].startswith(f"'{param}': cannot compile the "), answer


def test_llm_and_an_actor_backed_async_llm_refuse_an_uncompilable_schema_alike(tiny_model_dir):
    params = SamplingParams(max_tokens=4, guide=Guide.json_schema(NONSENSE))
    with pytest.raises(ValueError) as local:
        LLM(str(tiny_model_dir), **ENGINE).generate("Hi", params)

    async def through_an_actor() -> None:
        llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, **ENGINE)
        try:
            async for _ in llm.generate("Hi", params):
                pass
        finally:
            await llm.aclose()

    with pytest.raises(ValueError) as remote:
        asyncio.run(through_an_actor())
    assert str(local.value) == str(remote.value)
    assert str(local.value).startswith("cannot compile the json constraint") and "nonsense" in str(local.value)
