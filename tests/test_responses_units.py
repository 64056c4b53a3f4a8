"""The Responses API's parts without a model: items <-> chat messages, the request translated into the chat
request (one preparation), the field table walked, error names, the bounded store on a fake clock, and the
stream's event sequence."""
from __future__ import annotations

import itertools
import json

import pytest

from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from frontend.output import ReasoningOutput, ToolCallOutput
from frontend.reasoning import ReasoningFormat, ReasoningParser, Start
from frontend.responses_items import (ItemError, chat_messages, chat_response_format, chat_tool_choice, chat_tools,
                                      input_items)
from frontend.tool_parsers import HermesParser
from server.errors import ApiError
from server.protocol import RequestDefaults, parse_chat
from server.request_fields import REFUSED
from server.responses_events import OutputBuilder, OutputFeed, whole_output
from server.responses_fields import PASSED_TO_CHAT, RESPONSES_FIELDS
from server.responses_request import parse_responses, renamed
from server.responses_store import ResponseStore, StoreLimits

MODEL = "m"
WEATHER = {"type": "function", "name": "get_weather", "description": "the forecast",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def parse(body: dict, lookup=lambda rid: None):
    return parse_responses({"input": "hi", **body} if "input" not in body else body, MODEL, RequestDefaults(), lookup)


def refusal(body: dict, lookup=lambda rid: None) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body, lookup)
    return err.value


# ---------------------------------------------------------------------------------------- items -> messages

def test_a_text_input_is_one_user_message():
    assert chat_messages(input_items("hello")) == [{"role": "user", "content": "hello"}]


def test_message_items_easy_and_typed_with_text_parts():
    items = input_items([{"role": "developer", "content": "be brief"},
                         {"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                         {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}])
    assert chat_messages(items) == [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "ab"},
                                    {"role": "assistant", "content": "ok"}]


def test_calls_join_the_assistant_message_and_outputs_become_tool_messages():
    items = input_items([
        {"role": "user", "content": "weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "id": "fc_2"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}])
    calls = [{"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for cid, city in (("c1", "Oslo"), ("c2", "Rome"))]
    assert chat_messages(items) == [
        {"role": "user", "content": "weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain", "name": "get_weather"}]


def test_a_call_with_no_text_before_it_opens_an_assistant_message():
    items = input_items([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert chat_messages(items) == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


@pytest.mark.parametrize("value,param", [
    ("", "input"), (5, "input"), ([5], "input[0]"),
    ([{"type": "computer_call"}], "input[0].type"),
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"role": "user", "content": None}], "input[0].content"),
    ([{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
     "input[1].arguments"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input[0].output"),
])
def test_bad_items_name_the_field(value, param):
    with pytest.raises(ItemError) as err:
        input_items(value)
    assert err.value.param == param and param in str(err.value)


# ---------------------------------------------------------------------------------------- tools and format

def test_function_tools_and_a_named_choice_take_chat_spelling():
    assert chat_tools([WEATHER]) == [CHAT_WEATHER]
    assert chat_tool_choice({"type": "function", "name": "get_weather"}) == {"type": "function",
                                                                            "function": {"name": "get_weather"}}
    assert chat_tool_choice("required") == "required"


@pytest.mark.parametrize("tool", [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": []},
                                  {"type": "mcp", "server_label": "x"}, {"type": "custom", "name": "x"}])
def test_other_tool_types_are_refused_naming_them(tool):
    err = refusal({"tools": [WEATHER, tool]})
    assert err.status == 400 and err.param == "tools"
    assert repr(tool["type"]) in err.message and "tools[1]" in err.message


def test_text_format_takes_response_format_spelling():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert chat_response_format({"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}) \
        == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat_response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert chat_response_format({"format": {"type": "text"}}) == {"type": "text"}
    with pytest.raises(ItemError) as err:
        chat_response_format({"format": {"type": "json_schema", "name": "x"}})
    assert err.value.param == "text.format"


# ---------------------------------------------------------------------------------------- one preparation

def test_a_responses_request_is_the_chat_request_it_translates_to():
    fmt = {"type": "json_schema", "name": "w", "schema": {"type": "object"}}
    got = parse({"instructions": "be brief", "input": [{"role": "user", "content": "weather?"}],
                 "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                 "parallel_tool_calls": False, "max_output_tokens": 40, "temperature": 0.5, "top_p": 0.9,
                 "top_k": 7, "seed": 3, "stop": ["\n\n"], "stream": True})
    chat = parse_chat({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}],
                       "tools": [CHAT_WEATHER],
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                       "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0.5, "top_p": 0.9,
                       "top_k": 7, "seed": 3, "stop": ["\n\n"], "stream": True}, MODEL)
    assert got.chat == chat and got.stream
    formatted = parse({"text": {"format": fmt}})
    assert formatted.chat == parse_chat({"messages": [{"role": "user", "content": "hi"}],
                                         "response_format": {"type": "json_schema", "json_schema": {
                                             "name": "w", "schema": {"type": "object"}}}}, MODEL)


def test_the_response_echoes_the_settings_it_ran_with():
    echo = parse({"instructions": "x", "max_output_tokens": 5, "metadata": {"k": "v"}, "store": False,
                  "tools": [WEATHER]}).echo
    assert (echo["instructions"], echo["max_output_tokens"], echo["metadata"], echo["store"]) == ("x", 5, {"k": "v"},
                                                                                                 False)
    assert echo["tools"] == [WEATHER] and echo["tool_choice"] == "auto" and echo["temperature"] == 1.0
    assert echo["text"]["format"] == {"type": "text"}


@pytest.mark.parametrize("body,param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"tool_choice": "always", "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "other"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required", "text": {"format": {"type": "json_object"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": None}, "input"), ({"input": []}, "input"),
    ({"instructions": 3}, "instructions"), ({"store": "yes"}, "store"), ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"stream": "yes"}, "stream"), ({"typical_p": 0.5}, "typical_p"), ({"top_k": "x"}, "top_k"),
])
def test_bad_fields_are_400s_naming_them_as_responses_spells_them(body, param):
    err = refusal({"input": "hi", **body})
    assert err.status == 400 and err.param == param, err.message
    assert param.split(".")[0] in err.message
    assert "max_tokens" not in err.message and "response_format" not in err.message and "messages" not in err.message


def test_a_tool_name_error_names_the_responses_path():
    err = refusal({"tools": [{"type": "function", "name": "bad name!"}]})
    assert "'tools[0].name'" in err.message and ".function." not in err.message


def test_another_model_is_404():
    err = refusal({"model": "gpt-4o"})
    assert err.status == 404 and err.param == "model"


REFUSED_FIELDS = [name for name, fate in RESPONSES_FIELDS.items() if fate.fate == REFUSED]


@pytest.mark.parametrize("name", REFUSED_FIELDS)
def test_each_refused_field_is_a_400_naming_it_and_null_passes(name):
    fate = RESPONSES_FIELDS[name]
    err = refusal({name: fate.example})
    assert err.status == 400 and err.param == name and err.code == "unsupported_parameter" and fate.why in err.message
    assert parse({name: None}) == parse({})


def test_defaults_of_refused_fields_pass():
    assert parse({"background": False, "truncation": "disabled", "top_logprobs": 0, "include": [], "n": 1,
                  "reasoning": {"effort": None, "summary": None}}) == parse({})


def test_chat_fields_pass_through_and_responses_fields_do_not():
    assert {"top_k", "min_p", "seed", "stop", "ignore_eos", "guided_json", "logit_bias", "priority"} <= PASSED_TO_CHAT
    assert not {"max_tokens", "messages", "response_format", "tools", "stream", "n"} & PASSED_TO_CHAT
    assert parse({"ignore_eos": True, "min_tokens": 2}).chat.sampling.params.ignore_eos


def test_renamed_keeps_status_code_and_headers():
    err = renamed(ApiError(400, "'max_tokens' must be at most 5; the messages hold 9 tokens", "max_tokens", "x",
                           {"A": "b"}))
    assert (err.status, err.param, err.code, err.headers) == (400, "max_output_tokens", "x", {"A": "b"})
    assert err.message == "'max_output_tokens' must be at most 5; the input holds 9 tokens"
    assert renamed(ApiError(400, "'messages[2].content' bad", "messages[2].content")).param == "input[2].content"


# ---------------------------------------------------------------------------------------- previous_response_id

def test_previous_response_id_continues_the_stored_conversation_without_its_instructions():
    store = ResponseStore()
    first = parse({"instructions": "old rules", "input": "my name is Ada"})
    answer = [{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Hello Ada", "annotations": []}]}]
    assert store.put("resp_1", "me", {"id": "resp_1"}, [*first.conversation, *answer])
    second = parse({"instructions": "new rules", "input": "my name?", "previous_response_id": "resp_1"},
                   lambda rid: store.get(rid, "me"))
    assert second.chat.prompt == parse_chat({"messages": [
        {"role": "system", "content": "new rules"}, {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": "Hello Ada"}, {"role": "user", "content": "my name?"}]}, MODEL).prompt
    assert len(second.conversation) == 3 and second.echo["previous_response_id"] == "resp_1"


def test_an_unknown_previous_response_id_is_a_404_naming_it():
    err = refusal({"previous_response_id": "resp_nope"})
    assert err.status == 404 and err.param == "previous_response_id" and err.code == "previous_response_not_found"
    assert "resp_nope" in err.message and "expired" in err.message


# ---------------------------------------------------------------------------------------- the store

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, rid: str, owner: str = "me", text: str = "") -> bool:
    return store.put(rid, owner, {"id": rid, "text": text}, [])


def test_the_store_keeps_at_most_its_count_dropping_the_oldest():
    store = ResponseStore(StoreLimits(entries=3, bytes=1 << 20, seconds=60), FakeClock())
    for i in range(5):
        assert _put(store, f"r{i}")
    assert len(store) == 3 and [store.get(f"r{i}", "me") is not None for i in range(5)] == [False, False, True, True,
                                                                                            True]


def test_the_store_keeps_at_most_its_bytes():
    one = len(json.dumps({"id": "r0", "text": "x" * 100}, separators=(",", ":"))) + len("[]")
    store = ResponseStore(StoreLimits(entries=100, bytes=2 * one + 10, seconds=60), FakeClock())
    for i in range(3):
        assert _put(store, f"r{i}", text="x" * 100)
    assert store.get("r0", "me") is None and store.bytes == 2 * one
    assert not _put(store, "big", text="x" * (3 * one))  # larger than the whole store: not kept, nothing dropped
    assert store.get("big", "me") is None and len(store) == 2


def test_stored_responses_expire_on_the_clock():
    clock = FakeClock()
    store = ResponseStore(StoreLimits(entries=10, bytes=1 << 20, seconds=60), clock)
    _put(store, "old")
    clock.now += 30
    _put(store, "new")
    clock.now += 30  # "old" is 60 s old: gone; "new" is 30 s old
    assert store.get("old", "me") is None and store.get("new", "me") is not None
    clock.now += 29.5
    assert store.get("new", "me") is not None
    clock.now += 0.5
    assert store.get("new", "me") is None and len(store) == 0 and store.bytes == 0


def test_a_stored_response_is_its_owners_alone():
    store = ResponseStore()
    _put(store, "r", owner="alice")
    assert store.get("r", "bob") is None and not store.delete("r", "bob")
    assert store.get("r", "alice").response() == {"id": "r", "text": ""}
    assert store.delete("r", "alice") and store.get("r", "alice") is None and store.bytes == 0


def test_storing_an_id_again_replaces_it_and_counts_it_once():
    store = ResponseStore(StoreLimits(entries=2, bytes=1 << 20, seconds=60), FakeClock())
    _put(store, "a", text="one")
    _put(store, "a", text="two")
    _put(store, "b")
    assert len(store) == 2 and store.get("a", "me").response()["text"] == "two"


@pytest.mark.parametrize("limits", [dict(entries=0), dict(bytes=0), dict(seconds=0)])
def test_store_limits_must_leave_room(limits):
    with pytest.raises(ValueError):
        StoreLimits(**limits)


# ---------------------------------------------------------------------------------------- the event sequence

def _ids():
    counter = itertools.count()
    return lambda prefix: f"{prefix}{next(counter)}"


def _types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_a_text_reply_streams_its_events_in_order():
    builder = OutputBuilder(_ids())
    events = builder.text("Hel") + builder.text("") + builder.text("lo") + builder.finish("completed")
    assert _types(events) == ["response.output_item.added", "response.content_part.added",
                              "response.output_text.delta", "response.output_text.delta",
                              "response.output_text.done", "response.content_part.done",
                              "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")) == events[4]["text"] == "Hello"
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert builder.items == [events[-1]["item"]] and builder.items[0]["status"] == "completed"
    assert builder.items[0]["content"][0]["text"] == "Hello" and builder.items[0]["id"] == "msg_0"


def test_calls_close_the_message_and_each_other():
    builder = OutputBuilder(_ids())
    events = (builder.text("Sure.") + builder.call("call_a", "f") + builder.arguments('{"x"')
              + builder.arguments(": 1}") + builder.call("call_b", "g") + builder.arguments("{}")
              + builder.finish("completed"))
    assert _types(events) == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in builder.items] == [
        ("message", None, None), ("function_call", "call_a", '{"x": 1}'), ("function_call", "call_b", "{}")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert events[9]["arguments"] == '{"x": 1}' and events[9]["name"] == "f"


def test_a_cut_reply_marks_its_last_item_incomplete_and_an_empty_one_still_has_a_message():
    builder = OutputBuilder(_ids())
    builder.call("c", "f")
    builder.arguments('{"x": ')
    builder.finish("incomplete")
    assert builder.items[0]["status"] == "incomplete"
    empty = OutputBuilder(_ids())
    events = empty.finish("completed")
    assert _types(events)[0] == "response.output_item.added" and empty.items[0]["content"][0]["text"] == ""


def test_reasoning_comes_as_its_own_item_before_the_message():
    builder = OutputBuilder(_ids())
    events = builder.reasoning("think") + builder.text("answer") + builder.finish("completed")
    assert _types(events)[:6] == ["response.output_item.added", "response.content_part.added",
                                  "response.reasoning_text.delta", "response.reasoning_text.done",
                                  "response.content_part.done", "response.output_item.done"]
    assert [i["type"] for i in builder.items] == ["reasoning", "message"]
    assert builder.items[0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def _output(delta: str, finish: str | None = None) -> RequestOutput:
    sample = CompletionOutput(0, delta_text=delta, finish_reason=finish)
    return RequestOutput("r", None, [1, 2], [sample], RequestMetrics(0.0), finished=finish is not None)


def test_a_streamed_tool_call_is_read_into_call_events_like_the_whole_reply():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = ToolCallOutput(HermesParser())
    builder = OutputBuilder(_ids())
    feed = OutputFeed(builder, tools)
    events = []
    for i in range(0, len(text), 7):
        events += feed.feed(_output(text[i:i + 7]))
    events += feed.feed(_output("", "stop")) + builder.finish("completed")
    whole = whole_output(OutputBuilder(_ids()), text, tools, "completed")
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in builder.items] == \
        [(i["type"], i.get("name"), i.get("arguments")) for i in whole]
    assert whole[1]["name"] == "get_weather" and json.loads(whole[1]["arguments"]) == {"city": "Oslo"}
    assert whole[0]["content"][0]["text"] == "Let me check."
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"city": "Oslo"}


def test_a_whole_reply_cut_inside_a_second_call_keeps_the_first_call():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = call + '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    tools = ToolCallOutput(HermesParser())
    cut = whole_output(OutputBuilder(_ids()), text, tools, "incomplete")
    assert [i["type"] for i in cut if i["type"] == "function_call"] == ["function_call"]
    assert json.loads(next(i for i in cut if i["type"] == "function_call")["arguments"]) == {"city": "Oslo"}
    assert not any("<tool_call>" in c.get("text", "") for i in cut for c in i.get("content", []))


QWEN3 = ReasoningOutput(ReasoningParser(ReasoningFormat.QWEN3), Start.OPEN)
THOUGHT = '<think>The user wants weather.</think>\n\n'


def test_a_streamed_thinking_reply_is_a_reasoning_item_then_the_message_and_calls_like_the_whole():
    text = THOUGHT + 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = ToolCallOutput(HermesParser())
    builder = OutputBuilder(_ids())
    feed = OutputFeed(builder, tools, QWEN3)
    events = []
    for i in range(0, len(text), 5):
        events += feed.feed(_output(text[i:i + 5]))
    events += feed.feed(_output("", "stop")) + builder.finish("completed")
    whole = whole_output(OutputBuilder(_ids()), text, tools, "completed", QWEN3)
    assert [i["type"] for i in builder.items] == [i["type"] for i in whole] == ["reasoning", "message",
                                                                               "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert whole[0]["summary"] == [] and builder.items[0]["content"] == whole[0]["content"]
    assert whole[1]["content"][0]["text"] == "Checking."
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "The user wants weather."
    kinds = _types(events)
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_every_reasoning_event_validates_against_the_openai_clients_types():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    builder = OutputBuilder(_ids())
    feed = OutputFeed(builder, None, QWEN3)
    events = feed.feed(_output(THOUGHT + "Hi.", "stop")) + builder.finish("completed")
    for event in events:
        assert adapter.validate_python(event).type == event["type"]
    assert "response.reasoning_text.delta" in _types(events)


def test_a_reasoning_item_handed_back_is_kept_in_the_conversation_but_not_the_prompt():
    item = whole_output(OutputBuilder(_ids()), THOUGHT + "Hi.", None, "completed", QWEN3)[0]
    kept = input_items([{"role": "user", "content": "hi"}, item])
    assert kept[1] == {"type": "reasoning", "summary": [], "content": item["content"]}
    assert chat_messages(kept) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("reasoning, kwargs", [({"effort": "none"}, {"enable_thinking": False}),
                                               ({"effort": None}, {}), ({}, {})])
def test_reasoning_effort_none_turns_thinking_off(reasoning, kwargs):
    parsed = parse({"reasoning": reasoning})
    assert parsed.chat.template_kwargs == kwargs
    assert parsed.echo["reasoning"] == {"effort": reasoning.get("effort"), "summary": None}


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"), ({"reasoning": {"effort": "minimal"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"reasoning": {"budget": 5}}, "reasoning.budget"), ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": "none"}, "enable_thinking": True}, "reasoning.effort"),
    ({"reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}}, "reasoning.effort")])
def test_reasoning_settings_that_cannot_be_honoured_are_400s_naming_the_field(body, param):
    err = refusal(body)
    assert err.status == 400 and err.param == param and f"'{param}'" in err.message


# ---------------------------------------------------------------------------------------- the bench's share

def test_the_load_tests_share_goes_to_responses_evenly_and_reads_its_events():
    from bench import load_test

    cfg = load_test.LoadConfig("http://x", requests=8, max_tokens=5, responses_share=0.5)
    paths = [load_test.request_body(cfg, i)[0] for i in range(8)]
    assert paths == ["/v1/chat/completions", "/v1/responses"] * 4
    assert [load_test.via_responses(load_test.LoadConfig("http://x", responses_share=s), i)
            for s in (0.0, 1.0) for i in range(3)] == [False] * 3 + [True] * 3
    body = load_test.request_body(cfg, 1)[1]
    assert body["max_output_tokens"] == 5 and body["ignore_eos"] and body["stream"] and body["input"]
    builder = OutputBuilder(_ids())
    events = builder.text("ab") + builder.finish("completed")
    assert load_test.chunk_text(events[2]) == "ab" and load_test.chunk_output_tokens(events[2]) is None
    completed = {"type": "response.completed", "response": {"usage": {"output_tokens": 5}}}
    assert load_test.chunk_output_tokens(completed) == 5
    assert load_test.chunk_error({"type": "error", "message": "boom"}) == "boom"
    with pytest.raises(ValueError):
        load_test.LoadConfig("http://x", responses_share=1.5)
