"""/v1/responses through the real server on a tiny model (a decode actor), with the official openai client and
raw HTTP: bad input fuzzed (4xx naming the field, never a 5xx, never reaching the engine), the stream's event
order and its text and arguments against the whole reply, a forced call and its output sent back, the store's
bounds and owners through the routes, and a client that leaves mid-stream aborting its engine request. The tiny
random model cannot choose a tool itself, so calls are forced (tool_choice), where the grammar makes them valid."""
from __future__ import annotations

import http.client
import json
import random

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import TINY_ENGINE_FLAGS, ServerProcess, openai_client, start_server, wait_until
from tests.test_tool_calls_api import check_arguments
from tests.tiny_models import tiny_llama_config, write_tiny_model

MODEL = "tiny-responses"
STORE_ENTRIES = 3
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
GREEDY = {"temperature": 0, "max_output_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-responses"),
                              tiny_llama_config(num_key_value_heads=2, max_position_embeddings=4096), seed=7)
    proc = start_server(tmp_path_factory.mktemp("responses") / "server.log", "--model", str(folder),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL,
                        "--responses-store-entries", str(STORE_ENTRIES),
                        "--default-max-tokens", "16")  # a fuzzed body without max_output_tokens stays short
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _post(server: ServerProcess, body: bytes | dict, key: str = "k1"):
    return server.post("/v1/responses", body, headers={"Authorization": f"Bearer {key}",
                                                       "Content-Type": "application/json"})


def _engine_counters(server: ServerProcess) -> dict[str, float]:
    families = text_string_to_metric_families(server.get("/metrics").body.decode())
    wanted = ("phase_serve:prompt_tokens", "phase_serve:request_aborted", "phase_serve:request_success")
    return {f.name: sum(s.value for s in f.samples if s.name.endswith("_total")) for f in families
            if f.name in wanted}


# ---------------------------------------------------------------------------------------- bad input

BAD = [
    (b"{not json", 400, None),
    (b"[1]", 400, None),
    ({}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": 3}, 400, "input"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input[0].content[0]"),
    ({"input": "hi", "model": "gpt-4o"}, 404, "model"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"input": "x " * 5000}, 400, "input"),
    ({"input": "hi", "max_tokens": 5}, 400, "max_tokens"),
    ({"input": "hi", "temperature": 9}, 400, "temperature"),
    ({"input": "hi", "top_p": 0}, 400, "top_p"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
    ({"input": "hi", "reasoning": "high"}, 400, "reasoning"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "stream": "yes"}, 400, "stream"),
    ({"input": "hi", "typical_p": 0.5}, 400, "typical_p"),
]
# Refused where the engine compiles it, and still named as Responses spells it.
REFUSED_BY_ENGINE = [({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": {"type": "nonsense"}}}}, 400, "text.format")]


@pytest.mark.parametrize("body,status,param", BAD + REFUSED_BY_ENGINE,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD + REFUSED_BY_ENGINE)])
def test_bad_input_is_an_openai_error_naming_the_field(server, body, status, param):
    result = _post(server, body)
    assert result.status == status, result.body
    error = result.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if param is not None:
        assert param.split("[")[0] in error["message"]


def test_bad_input_never_reaches_the_engine(server):
    before = _engine_counters(server)
    for body, _, _ in BAD:
        _post(server, body)
    assert _engine_counters(server) == before


JUNK = [None, 0, -1, 1.5, 10 ** 12, True, "", "x", [], [1, "a"], {}, {"type": "x"}, [{}], {"a": [None]}]
VALID = {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2, "temperature": 0, "top_p": 1,
         "instructions": "be brief", "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True,
         "text": {"format": {"type": "text"}}, "store": False, "metadata": {"a": "b"}, "stream": False,
         "previous_response_id": None, "top_k": 5, "seed": 1, "stop": ["\n"], "reasoning": {"effort": "none"}}


def test_fuzzed_fields_are_answered_or_refused_by_name_never_a_5xx(server):
    rng = random.Random(38)
    cases = [(name, junk) for name in VALID for junk in JUNK]
    nested = [("input", [{"role": "user", "content": junk}]) for junk in JUNK]
    nested += [("input", [{"type": "function_call", "call_id": junk, "name": "f", "arguments": "{}"}]) for junk in JUNK]
    nested += [("text", {"format": {"type": "json_schema", "name": "x", "schema": junk}}) for junk in JUNK]
    nested += [("tools", [{"type": "function", "name": "f", "parameters": junk}]) for junk in JUNK]
    nested += [("reasoning", {key: junk}) for key in ("effort", "summary", "generate_summary") for junk in JUNK]
    for name, junk in cases + nested + [(rng.choice(list(VALID)), rng.choice(JUNK)) for _ in range(20)]:
        result = _post(server, VALID | {name: junk})
        assert result.status in (200, 400, 404), (name, junk, result.body)
        if result.status != 200:
            param = result.json()["error"]["param"]
            assert param is not None and param.split(".")[0].split("[")[0] == name, (name, junk, result.body)


# ---------------------------------------------------------------------------------------- text and events

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def _squeezed(types: list[str]) -> list[str]:
    """The event types with each run of deltas as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_a_stream_is_the_whole_reply_in_typed_events(client):
    whole = client.responses.create(model=MODEL, input="Hello there", store=False, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Hello there", store=False, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert _squeezed(types) == TEXT_EVENTS + ["response.incomplete"]  # 12 tokens: cut by max_output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text and text
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == events[-1].response.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id


def _stream_call(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                        **{"max_output_tokens": 400, "temperature": 0, **kwargs}))


def test_a_forced_call_streams_as_a_function_call_item_and_its_output_goes_back(client):
    events = _stream_call(client, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    assert _squeezed([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1].response
    call = done.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == arguments
    assert events[-3].arguments == arguments and call.status == "completed"
    check_arguments(call.name, arguments)
    answer = client.responses.create(model=MODEL, previous_response_id=done.id, tools=[WEATHER], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"forecast": "sunny"})}])
    assert answer.status in ("completed", "incomplete") and answer.previous_response_id == done.id
    assert answer.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
    restated = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, store=False, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sunny"})}])
    assert restated.usage.input_tokens == answer.usage.input_tokens  # the stored conversation is the same prompt


def test_required_is_a_call_of_an_offered_tool_whole_and_streamed_alike(client):
    whole = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=400, temperature=0, store=False)
    streamed = _stream_call(client, tool_choice="required", parallel_tool_calls=False, store=False)[-1].response
    assert [(o.type, o.name, o.arguments) for o in whole.output] == \
        [(o.type, o.name, o.arguments) for o in streamed.output]
    check_arguments(whole.output[0].name, whole.output[0].arguments)


def test_a_call_cut_by_max_output_tokens_is_incomplete_and_the_conversation_goes_on(client):
    # Where the tiny model's call names its tool depends on the CPU's kernels, so the cut is set from the whole
    # call: one token short of it, its name is known and its close is not.
    forced = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = _stream_call(client, **forced)[-1].response
    assert whole.status == "completed" and [o.type for o in whole.output] == ["function_call"]
    events = _stream_call(client, **forced, max_output_tokens=whole.usage.output_tokens - 1)
    cut = events[-1].response
    assert events[-1].type == "response.incomplete" and cut.output[-1].status == "incomplete"
    assert cut.output[-1].type == "function_call" and cut.output[-1].name == whole.output[0].name and cut.store
    assert whole.output[0].arguments.startswith(cut.output[-1].arguments)
    after = client.responses.create(model=MODEL, previous_response_id=cut.id, input="Never mind.", max_output_tokens=2)
    assert after.status in ("completed", "incomplete")


def test_a_json_schema_format_is_followed(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="A city as JSON", max_output_tokens=200, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                   "strict": True}})
    parsed = json.loads(out.output_text)
    assert set(parsed) == {"city"} and len(parsed["city"]) <= 10 and out.text.format.type == "json_schema"


def _raw_events(server: ServerProcess, body: dict) -> list[dict]:
    result = _post(server, body | {"stream": True})
    assert result.status == 200 and result.headers["Content-Type"].startswith("text/event-stream")
    blocks = [b for b in result.body.decode().split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data.removeprefix("data: ")))
        assert events[-1]["type"] == name.removeprefix("event: ")
    return events


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER], "tool_choice": "required"}], ids=["text", "call"])
def test_every_event_and_response_validates_against_the_clients_types(server, extra):
    body = {"input": "Weather in Oslo?", "max_output_tokens": 60, "temperature": 0, "store": False, **extra}
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for event in _raw_events(server, body):
        adapter.validate_python(event)  # strict: every required field present, every literal known
    Response.model_validate(_post(server, body).json())


# ---------------------------------------------------------------------------------------- the store

def test_the_store_keeps_the_newest_responses_for_their_owner(server, client):
    ids = [client.responses.create(model=MODEL, input=f"turn {i}", max_output_tokens=2).id
           for i in range(STORE_ENTRIES + 1)]
    gone, kept = ids[0], ids[-1]
    assert client.responses.retrieve(kept).id == kept
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(gone)
    assert err.value.body["code"] == "response_not_found" and gone in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=gone)
    assert err.value.body["param"] == "previous_response_id"
    other = server.get(f"/v1/responses/{kept}", headers={"Authorization": "Bearer someone-else"})
    assert other.status == 404
    assert server.get(f"/v1/responses/{kept}?stream=true", headers={"Authorization": "Bearer unused"}).json()[
        "error"]["param"] == "stream"
    cancel = server.post(f"/v1/responses/{kept}/cancel", b"", headers={"Authorization": "Bearer unused"})
    assert cancel.status == 400 and cancel.json()["error"]["code"] == "not_cancellable"
    client.responses.delete(kept)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept)
    assert server.post(f"/v1/responses/{kept}/cancel", b"", headers={"Authorization": "Bearer unused"}).status == 404


def test_store_false_keeps_nothing_and_says_so(client):
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_a_retrieved_response_is_the_one_returned(client):
    out = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, metadata={"run": "38"})
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump() and got.metadata == {"run": "38"} and got.store is True


def test_the_404_sentence_names_the_responses_route(server):
    assert "POST /v1/responses" in server.get("/v1/nothing").json()["error"]["message"]


# ---------------------------------------------------------------------------------------- disconnects

def _status(server: ServerProcess) -> dict:
    return server.get("/status").json()


def test_a_client_that_leaves_mid_stream_aborts_its_request(server):
    before = _engine_counters(server)
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"input": "Hello", "max_output_tokens": 2000, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = []
    while len(seen) < 4:
        line = response.readline()
        if line.startswith(b"event:"):
            seen.append(line.split(b":", 1)[1].strip().decode())
    assert seen[:2] == ["response.created", "response.in_progress"]
    assert wait_until(lambda: _status(server)["running"] == 1, 5.0)
    conn.close()
    assert wait_until(lambda: (s := _status(server))["running"] == 0 and s["kv_blocks"]["used"] == 0, 5.0)
    after = _engine_counters(server)
    assert after["phase_serve:request_aborted"] == before["phase_serve:request_aborted"] + 1
    assert after["phase_serve:request_success"] == before["phase_serve:request_success"]
