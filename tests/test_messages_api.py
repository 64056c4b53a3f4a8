"""Anthropic's Messages API on the real default model (SmolLM2-135M-Instruct) through `serve`, driven by the
official anthropic client: a text reply, a streamed one whose deltas join to the same reply (events in
Anthropic's order), a forced tool use whose input follows the schema, whole and streamed, a tool_result turn,
stop sequences and max_tokens as stop reasons, count_tokens equal to the prompt the server runs (and to the chat
route's prompt for the same conversation), and bad input, listed and fuzzed, answered with a 4xx in
Anthropic's error shape. Replies are printed in the test log."""
from __future__ import annotations

import json

import anthropic
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.server_utils import start_server
from tests.test_anthropic_messages import check_event_order
from tests.test_tool_calls_api import WEATHER as OPENAI_WEATHER, check_arguments

pytestmark = pytest.mark.slow
MODEL = "smollm2"
GREEDY = {"model": MODEL, "extra_body": {"temperature": 0}}  # the client's create() no longer names temperature
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
OSLO = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]
WEATHER = {"name": "get_weather", "description": "The weather forecast for a city",
           "input_schema": OPENAI_WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("smollm2-messages") / "server.log", "--served-model-name", MODEL,
                        "--num-kv-blocks", "256", "--threads", "2")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


# ---------------------------------------------------------------------------------------- text

def test_a_text_reply(client):
    reply = client.messages.create(max_tokens=32, messages=FRANCE, **GREEDY)
    print(f"\nSmolLM2 message: {_text(reply)!r}")
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    assert "Paris" in _text(reply) and reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 32


def test_the_same_conversation_gets_the_chat_routes_reply_and_prompt(client, server):
    system = "You answer in one short sentence."
    reply = client.messages.create(max_tokens=32, system=system, messages=FRANCE, **GREEDY)
    chat = server.post("/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 32, "messages": [
        {"role": "system", "content": system}, *FRANCE]}).json()
    assert _text(reply) == chat["choices"][0]["message"]["content"]
    assert _prompt_tokens(reply.usage) == chat["usage"]["prompt_tokens"]
    assert reply.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_streamed_deltas_join_to_the_final_message_in_anthropics_event_order(client):
    whole = client.messages.create(max_tokens=32, messages=FRANCE, **GREEDY)
    with client.messages.stream(max_tokens=32, messages=FRANCE, **GREEDY) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    events = list(client.messages.create(max_tokens=32, messages=FRANCE, stream=True, **GREEDY))
    check_event_order([e.type for e in events])
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_before_it_and_is_named(client):
    full = _text(client.messages.create(max_tokens=32, messages=FRANCE, **GREEDY))
    cut = client.messages.create(max_tokens=32, messages=FRANCE, stop_sequences=["Paris"], **GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in _text(cut) and full.startswith(_text(cut))


def test_max_tokens_is_the_stop_reason_at_the_limit(client):
    reply = client.messages.create(max_tokens=3, messages=FRANCE, **GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


def test_a_max_tokens_past_the_context_is_a_ceiling_as_claude_code_sends_it(client, server):
    context = server.get("/v1/models").json()["data"][0]["max_model_len"]
    reply = client.messages.create(max_tokens=context + 32000, messages=FRANCE, **GREEDY)
    assert "Paris" in _text(reply) and reply.stop_reason == "end_turn"
    chat = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": context + 32000, "messages": FRANCE})
    assert chat.status == 400 and chat.json()["error"]["param"] == "max_tokens"


# ---------------------------------------------------------------------------------------- tools

def test_a_forced_tool_use_follows_the_schema_and_a_tool_result_turn_answers(client):
    # One call: with parallel calls allowed, greedy SmolLM2 repeats the same call until max_tokens.
    call = client.messages.create(max_tokens=80, messages=OSLO, tools=[WEATHER],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    uses = [b for b in call.content if b.type == "tool_use"]
    print(f"\nSmolLM2 tool use: {[(u.name, u.input) for u in uses]}")
    assert call.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    check_arguments(uses[0].name, json.dumps(uses[0].input))
    assert "Oslo" in uses[0].input["city"]
    history = [*OSLO, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": json.dumps({"forecast": "sunny", "high_c": 21})}]}]
    answer = client.messages.create(max_tokens=48, messages=history, tools=[WEATHER], **GREEDY)
    print(f"SmolLM2 answer after the tool result: {answer.content!r}")
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert counted.input_tokens == _prompt_tokens(answer.usage)


def test_a_streamed_tool_use_streams_its_input_as_json_deltas(client):
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    events = list(client.messages.create(max_tokens=80, messages=OSLO, tools=[WEATHER], tool_choice=choice,
                                         stream=True, **GREEDY))
    check_event_order([e.type for e in events])
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    index = next(i for i, b in enumerate(starts) if b.type == "tool_use")
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert all(e.index == index for e in events if e.type == "content_block_delta"
               and e.delta.type == "input_json_delta")
    check_arguments("get_weather", partial)
    assert events[-2].delta.stop_reason == "tool_use"
    whole = client.messages.create(max_tokens=80, messages=OSLO, tools=[WEATHER], tool_choice=choice, **GREEDY)
    assert [b.input for b in whole.content if b.type == "tool_use"] == [json.loads(partial)]


# ---------------------------------------------------------------------------------------- count_tokens

def test_count_tokens_is_the_prompt_the_server_runs(client):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in French."}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=FRANCE, tools=[WEATHER])
    reply = client.messages.create(max_tokens=2, system=system, messages=FRANCE, tools=[WEATHER], **GREEDY)
    assert counted.input_tokens == _prompt_tokens(reply.usage) > 0
    plain = client.messages.count_tokens(model=MODEL, messages=FRANCE)
    assert plain.input_tokens < counted.input_tokens  # the system prompt and the tools are counted


# ---------------------------------------------------------------------------------------- bad input

def test_the_client_sees_anthropics_errors(client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(max_tokens=8, messages=FRANCE, thinking={"type": "enabled", "budget_tokens": 1024},
                               **GREEDY)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "'thinking'" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(max_tokens=8, messages=FRANCE, model="claude-sonnet-4-5")
    assert missing.value.body["error"]["type"] == "not_found_error"


OK_BODY = {"model": MODEL, "max_tokens": 1, "messages": FRANCE}
BAD = [
    ("/v1/messages", b"{not json", 400, None),
    ("/v1/messages", b"[1]", 400, None),
    ("/v1/messages", {"model": MODEL, "messages": FRANCE}, 400, "max_tokens"),
    ("/v1/messages", OK_BODY | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/messages", OK_BODY | {"max_tokens": -3}, 400, "max_tokens"),
    ("/v1/messages", OK_BODY | {"max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/messages", OK_BODY | {"messages": []}, 400, "messages"),
    ("/v1/messages", OK_BODY | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "messages[0].content[0].type"),
    ("/v1/messages", OK_BODY | {"messages": [*FRANCE, {"role": "assistant", "content": "The"}]}, 400, "messages"),
    ("/v1/messages", OK_BODY | {"temperature": 5}, 400, "temperature"),
    ("/v1/messages", OK_BODY | {"top_k": -7}, 400, "top_k"),
    ("/v1/messages", OK_BODY | {"stop_sequences": ["s"] * 40}, 400, "stop_sequences"),
    ("/v1/messages", OK_BODY | {"thinking": {"type": "adaptive"}}, 400, "thinking"),
    ("/v1/messages", OK_BODY | {"tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    ("/v1/messages", OK_BODY | {"tool_choice": {"type": "tool", "name": "f"}}, 400, "tool_choice"),
    ("/v1/messages", OK_BODY | {"stream": "yes"}, 400, "stream"),
    ("/v1/messages", OK_BODY | {"model": "claude"}, 404, "model"),
    ("/v1/messages", OK_BODY | {"messages": [{"role": "user", "content": "hello " * 10000}]}, 400, "messages"),
    ("/v1/messages/count_tokens", {"messages": "hi"}, 400, "messages"),
    ("/v1/messages/count_tokens", {"messages": FRANCE, "output_format": {"type": "json_schema", "schema": {}}}, 400,
     "output_format"),
    ("/v1/messages/nothing", OK_BODY, 404, None),
]


def _check_anthropic_error(status: int, body: dict, param: str | None) -> None:
    assert 400 <= status < 500 and body["type"] == "error", body
    kind = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}[status]
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert param is None or param in body["error"]["message"], body


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_4xx_in_anthropics_shape(server, path, body, status, param):
    result = server.post(path, body)
    assert result.status == status, result.body
    _check_anthropic_error(result.status, result.json(), param)


def test_a_wrong_method_is_a_405_in_anthropics_shape(server):
    result = server.get("/v1/messages")
    assert result.status == 405 and result.headers["Allow"] == "POST"
    _check_anthropic_error(405, result.json(), None)


def test_the_404_sentence_lists_the_messages_routes(server):
    message = server.get("/v1/nothing").json()["error"]["message"]  # OpenAI's shape outside /v1/messages
    assert "POST /v1/messages," in message and "POST /v1/messages/count_tokens" in message


SMALL_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-3, 3) | st.text(max_size=6),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3), max_leaves=6)
FUZZED = ["model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "tools", "tool_choice", "thinking", "output_config", "metadata", "messages[0]", "content", "min_p", "seed",
          "stop", "n", "logprobs", "enable_thinking", "chat_template_kwargs", "guided_regex"]


def _fuzzed(field: str, value) -> dict:
    body = {**OK_BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    if field == "messages[0]":
        body["messages"] = [value]
    elif field == "content":
        body["messages"] = [{"role": "user", "content": value}]
    else:
        body[field] = value
    return body


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), st.sampled_from(FUZZED), SMALL_JSON)
def test_fuzzed_requests_are_answered_or_refused_with_a_4xx_in_anthropics_shape(server, path, field, value):
    result = server.post(path, _fuzzed(field, value))
    if result.status == 200:
        streamed = result.headers["Content-Type"].startswith("text/event-stream")
        if path.endswith("count_tokens"):
            assert result.json()["input_tokens"] > 0
        else:
            assert result.body.startswith(b"event: message_start") if streamed else result.json()["type"] == "message"
        return
    _check_anthropic_error(result.status, result.json(), None)
