"""The real default model (SmolLM2-135M-Instruct) through `serve` and the official openai client: a greedy
answer to a plain question, and the OpenAI features agent frameworks send: a parsed structured output, a forced
tool call whose arguments follow the schema, and a tool-result round trip. Replies are printed in the test
log."""
from __future__ import annotations

import json

import pydantic
import pytest

from tests.server_utils import openai_client, start_server
from tests.test_tool_calls_api import WEATHER, check_arguments

pytestmark = pytest.mark.slow
MODEL = "smollm2"


class City(pydantic.BaseModel):
    """Every field bounded in length: greedy SmolLM2 may otherwise run a number's digits on to max_tokens, and
    where it does depends on the kernels' bf16 rounding (AMX tiles or AVX-512 vectors)."""

    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: str = pydantic.Field(max_length=16)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("smollm2-api") / "server.log", "--served-model-name", MODEL,
                          "--num-kv-blocks", "256", "--threads", "2")
    yield openai_client(server)
    assert server.stop() == 0, server.log()


def test_the_default_model_knows_the_capital_of_france(client):
    out = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=32,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    print(f"\nSmolLM2: {out.choices[0].message.content!r}")
    assert "Paris" in out.choices[0].message.content


def test_parse_returns_a_valid_pydantic_object(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON: name, country, population."}],
        response_format=City, max_tokens=100, temperature=0)
    city = done.choices[0].message.parsed
    print(f"\nSmolLM2 parsed: {city!r}")
    assert isinstance(city, City) and city.name


def test_a_required_tool_call_follows_the_schema_and_round_trips(client):
    ask = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]
    # One call: with parallel calls allowed, greedy SmolLM2 repeats the same call until max_tokens.
    call = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=80, temperature=0).choices[0]
    assert call.finish_reason == "tool_calls" and len(call.message.tool_calls) == 1
    first = call.message.tool_calls[0]
    print(f"\nSmolLM2 tool call: {first.function.name}({first.function.arguments})")
    check_arguments(first.function.name, first.function.arguments)
    assert "Oslo" in json.loads(first.function.arguments)["city"]
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": first.id, "type": "function",
         "function": {"name": first.function.name, "arguments": first.function.arguments}}]},
        {"role": "tool", "tool_call_id": first.id, "content": json.dumps({"forecast": "sunny", "high_c": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=48,
                                            temperature=0).choices[0]
    print(f"SmolLM2 answer after the tool result: {answer.message.content!r}")
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content or answer.message.tool_calls
