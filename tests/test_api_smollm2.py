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
    """No field bounded by the schema: the grammar's own bounds (a number's digits, the whitespace between
    tokens) must close the object, where greedy SmolLM2 would otherwise write `"population": 3222…` on to
    max_tokens."""

    name: str
    country: str
    population: int


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


@pytest.mark.parametrize("ask", ["Describe Paris as JSON: name, country, population.",
                                 "What is the largest city in Japan? Answer in JSON.", "Describe Tokyo as JSON."])
def test_parse_of_an_integer_field_completes_within_80_tokens(client, ask):
    done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ask}],
                                         response_format=City, max_tokens=80, temperature=0)
    city = done.choices[0].message.parsed
    print(f"\nSmolLM2 parsed: {city!r} in {done.usage.completion_tokens} tokens")
    assert done.choices[0].finish_reason == "stop" and isinstance(city, City) and city.name


@pytest.mark.parametrize("ask", ["Tell me about Berlin.", "Describe Paris as JSON."])
def test_a_json_object_completes_within_80_tokens(client, ask):
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                          response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    print(f"\nSmolLM2 json_object: {done.choices[0].message.content!r}")
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content), dict)


def _tokens_through(tokens: list[str], end: int) -> int:
    """How many of `tokens` it takes for their joined text to reach character `end`."""
    length = 0
    for count, token in enumerate(tokens, 1):
        length += len(token)
        if length >= end:
            return count
    raise AssertionError(f"the tokens end before character {end}")


def test_required_calls_cut_by_max_tokens_keep_the_calls_that_closed(client):
    ask = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, temperature=0, logprobs=True).choices[0]
    assert len(whole.message.tool_calls) >= 2, whole.message
    tokens = [t.token for t in whole.logprobs.content]
    text = "".join(tokens)
    first_end = text.index("</tool_call>") + len("</tool_call>")
    first = _tokens_through(tokens, first_end)  # the first call, tags and all
    second = _tokens_through(tokens, text.index("}}", first_end) + 2)  # through the second call's JSON
    cut = (first + second) // 2
    assert first < cut < second, (first, second)
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                           max_tokens=cut, temperature=0)
    assert reply.usage.completion_tokens == cut
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [(whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]
    check_arguments(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required",
                                            max_tokens=cut, temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    calls = [call for c in chunks for call in c.delta.tool_calls or ()]
    assert {call.index for call in calls} == {0} and chunks[-1].finish_reason == "length"
    assert "".join(call.function.arguments or "" for call in calls) == choice.message.tool_calls[0].function.arguments
    assert not "".join(c.delta.content or "" for c in chunks)


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
