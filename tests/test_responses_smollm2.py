"""The real default model (SmolLM2-135M-Instruct) through `serve` and the official openai client's Responses
API: a text reply, the same reply streamed (its deltas joining to it, in OpenAI's event order), a forced function
call whose output goes back in a second call, a json_schema format parsed into a Pydantic object, a
conversation continued with previous_response_id (the chat route's reply to the same conversation; an
unknown id refused), and a stored response fetched.
Replies are printed in the test log."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server_utils import openai_client, start_server
from tests.test_api_smollm2 import City
from tests.test_responses_api import TEXT_EVENTS, _squeezed

pytestmark = pytest.mark.slow
MODEL = "smollm2"
FRANCE = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("smollm2-responses") / "server.log", "--served-model-name", MODEL,
                        "--num-kv-blocks", "256", "--threads", "2")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def france(client):
    out = client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=32)
    print(f"\nSmolLM2 (responses): {out.output_text!r}")
    return out


def test_a_text_reply(france):
    assert "Paris" in france.output_text and france.status in ("completed", "incomplete")
    assert [item.type for item in france.output] == ["message"] and france.usage.output_tokens <= 32


def test_a_streamed_reply_is_the_same_text_in_typed_events(client, france):
    events = list(client.responses.create(model=MODEL, input=FRANCE, temperature=0, max_output_tokens=32,
                                          stream=True))
    final = events[-1].response
    assert _squeezed([e.type for e in events]) == TEXT_EVENTS + [f"response.{final.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == france.output_text


def test_a_function_call_and_its_output_sent_back(client):
    call = client.responses.create(model=MODEL, input="What is the weather in Oslo for the next 3 days?",
                                   tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                   parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [item] = call.output
    print(f"\nSmolLM2 call: {item.name}({item.arguments})")
    assert item.type == "function_call" and item.name == "get_weather" and call.status == "completed"
    args = json.loads(item.arguments)
    assert set(args) == {"city", "days"} and "Oslo" in args["city"] and 1 <= args["days"] <= 7
    answer = client.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=48, input=[{
                                         "type": "function_call_output", "call_id": item.call_id,
                                         "output": json.dumps({"forecast": "sunny", "high_c": 21})}])
    print(f"SmolLM2 after the tool output: {answer.output_text!r}")
    assert answer.status in ("completed", "incomplete") and answer.output
    assert answer.usage.input_tokens > call.usage.input_tokens


def test_a_json_schema_format_parses(client):
    done = client.responses.parse(model=MODEL, input="Describe Paris as JSON: name, country, population.",
                                  text_format=City, max_output_tokens=100, temperature=0)
    print(f"\nSmolLM2 parsed (responses): {done.output_parsed!r}")
    assert isinstance(done.output_parsed, City) and done.output_parsed.name
    assert City.model_validate_json(done.output_text) == done.output_parsed


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="My name is Alice and I live in Paris.", temperature=0,
                                    max_output_tokens=24, instructions="You are a helpful assistant.")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                     temperature=0, max_output_tokens=24)
    print(f"\nSmolLM2 turn 1: {first.output_text!r}\nSmolLM2 turn 2: {second.output_text!r}")
    conversation = [{"role": "user", "content": "My name is Alice and I live in Paris."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    counted = server.post("/tokenize", {"model": MODEL, "messages": conversation}).json()["count"]
    assert second.usage.input_tokens == counted  # both turns, without the first turn's instructions
    chat = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0, max_tokens=24)
    assert second.output_text == chat.choices[0].message.content  # the chat request it translates to
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id="resp_never", input="hi", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id" and "resp_never" in err.value.body["message"]


def test_a_stored_response_is_fetched_as_returned(client, france):
    got = client.responses.retrieve(france.id)
    assert got.model_dump() == france.model_dump() and got.output_text == france.output_text
