"""Anthropic's Messages API without a model: the request's translation into the chat route's body (and through
the chat route's parser), the table of its fields, the reply's event sequence (order checked), its whole body,
stop reasons and usage, the errors' shape, and fuzzed bodies that must be refused as a 4xx naming a field."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from frontend.anthropic_messages import ERROR_PREFIX, MESSAGES_FIELDS, MessagesError, chat_body, thinking_of
from frontend.output import ReasoningOutput, ToolCallOutput
from frontend.reasoning import ReasoningFormat, ReasoningParser, Start
from frontend.tool_parsers import HermesParser
from server.errors import ApiError
from server.messages_api import anthropic_error
from server.messages_events import MessageEvents, MessageMeta, encode_events, message_body, message_id, stop_reason
from server.protocol import parse_chat

MODEL = "served"
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
BASE = {"model": MODEL, "max_tokens": 16, "messages": ASK}
WEATHER = {"name": "get_weather", "description": "The forecast",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _error(body: dict, count: bool = False) -> MessagesError:
    with pytest.raises(MessagesError) as err:
        chat_body(body, count)
    return err.value


# ---------------------------------------------------------------------------------------- the translation

def test_system_text_and_sampling_fields_keep_their_meaning():
    body = BASE | {"system": "Be brief.", "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stream": True,
                   "stop_sequences": ["END", "\n\n"], "metadata": {"user_id": "u1"}}
    chat = chat_body(body)
    assert chat == {"model": MODEL, "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                    "stream": True, "stop": ["END", "\n\n"],
                    "messages": [{"role": "system", "content": "Be brief."}, *ASK]}
    params = parse_chat(chat, MODEL).sampling.params
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (0.5, 0.9, 20, ("END", "\n\n"))


def test_system_blocks_and_text_blocks_join_with_a_blank_line():
    body = BASE | {"system": [{"type": "text", "text": "One."}, {"type": "text", "text": "Two.",
                                                                 "cache_control": {"type": "ephemeral"}}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}]}
    assert chat_body(body)["messages"] == [{"role": "system", "content": "One.\n\nTwo."},
                                           {"role": "user", "content": "a\n\nb"}]


def test_a_tool_round_trip_becomes_tool_calls_and_tool_messages():
    history = [*ASK,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "hmm", "signature": "x"},
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                   {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                    "content": [{"type": "text", "text": "timeout"}]},
                   {"type": "text", "text": "And tomorrow?"}]}]
    messages = chat_body(BASE | {"messages": history, "tools": [WEATHER]})["messages"]
    assert messages[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": ERROR_PREFIX + "timeout"},
        {"role": "user", "content": "And tomorrow?"}]
    parsed = parse_chat(chat_body(BASE | {"messages": history, "tools": [WEATHER]}), MODEL)
    assert [m.role for m in parsed.prompt] == ["user", "assistant", "tool", "tool", "user"]


@pytest.mark.parametrize("content", ["", [], [{"type": "text", "text": ""}]])
def test_a_user_turn_of_no_text_is_still_a_turn(content):
    assert chat_body(BASE | {"messages": [{"role": "user", "content": content}]})["messages"] == [
        {"role": "user", "content": ""}]


def test_consecutive_turns_of_one_role_are_merged():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "assistant", "content": "d"},
                {"role": "user", "content": "e"}]
    assert chat_body(BASE | {"messages": messages})["messages"] == [
        {"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c\n\nd"},
        {"role": "user", "content": "e"}]


@pytest.mark.parametrize("choice,expected,parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice_maps_onto_the_chat_routes(choice, expected, parallel):
    chat = chat_body(BASE | {"tools": [WEATHER], "tool_choice": choice})
    assert chat["tool_choice"] == expected and chat.get("parallel_tool_calls", True) is parallel
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": "The forecast"}}]
    req = parse_chat(chat, MODEL)
    assert req.tool_choice.mode == {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice["type"]]
    assert req.parallel_tool_calls is parallel


def test_output_config_format_is_the_chat_routes_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat = chat_body(BASE | {"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert parse_chat(chat, MODEL).sampling.guide_param == "response_format"
    assert chat["response_format"]["json_schema"]["schema"] == schema


def test_strict_tools_need_a_forced_call():
    strict = WEATHER | {"strict": True}
    assert _error(BASE | {"tools": [strict]}).param == "tools[0].strict"
    assert chat_body(BASE | {"tools": [strict], "tool_choice": {"type": "any"}})["tool_choice"] == "required"


def test_count_tokens_needs_no_max_tokens_but_messages_does():
    assert _error({"messages": ASK}).param == "max_tokens"
    assert chat_body({"messages": ASK}, count=True) == {"messages": ASK}


BAD = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}, *ASK]},
     "messages[1].content[0].type"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                            "input": "{}"}]}, *ASK]}, "messages[1].content[0].input"),
    ({"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}, *ASK]},
     "messages[1].content[0].id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": "y"}]}]},
     "messages[0].content[0].is_error"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Sure,"}]}, "messages"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "image", "source": {}}]}, "system[0].type"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER | {"input_examples": [{"city": "Oslo"}]}]}, "tools[0].input_examples"),
    ({"tools": [WEATHER | {"defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [WEATHER | {"description": 3}]}, "tools[0].description"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": []}, "output_config"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_naming_the_field(change, param):
    err = _error(BASE | change)
    assert err.param == param and f"'{param}'" in str(err)


# ---------------------------------------------------------------------------------------- the table of fields

@pytest.mark.parametrize("name", [n for n, f in MESSAGES_FIELDS.items() if f.fate == "refused"])
def test_each_refused_field_is_refused_with_its_example(name):
    err = _error(BASE | {name: MESSAGES_FIELDS[name].example})
    assert err.param == name and MESSAGES_FIELDS[name].why in str(err)


@pytest.mark.parametrize("thinking, kwargs, budget, shown", [
    ({"type": "disabled"}, {"enable_thinking": False}, None, True),
    ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}, 1024, True),
    ({"type": "enabled", "budget_tokens": 8, "display": "omitted"}, {"enable_thinking": True}, 8, False),
    ({"type": "adaptive", "display": "summarized"}, {"enable_thinking": True}, None, True),
    (None, None, None, True)])
def test_thinking_reaches_the_template_and_the_budget(thinking, kwargs, budget, shown):
    body = BASE | {"thinking": thinking}
    chat = chat_body(body)
    assert chat.get("chat_template_kwargs") == kwargs
    assert parse_chat(chat, MODEL).template_kwargs == (kwargs or {})
    setting = thinking_of(body)
    assert (setting.budget_tokens, setting.shown, setting.asked) == (budget, shown, bool(kwargs and
                                                                                       kwargs["enable_thinking"]))


@pytest.mark.parametrize("thinking, param", [
    ("on", "thinking"), ({"budget_tokens": 5}, "thinking"), ({"type": "between_tools"}, "thinking.type"),
    ({"type": "sometimes"}, "thinking.type"), ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": "9"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": True}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 9, "display": "full"}, "thinking.display"),
    ({"type": "enabled", "budget_tokens": 9, "effort": "high"}, "thinking.effort"),
    ({"type": "disabled", "budget_tokens": 9}, "thinking.budget_tokens"),
    ({"type": "adaptive", "budget_tokens": 9}, "thinking.budget_tokens")])
def test_unsupported_thinking_is_refused_naming_the_sub_field(thinking, param):
    err = _error(BASE | {"thinking": thinking})
    assert err.param == param and f"'{param}'" in str(err)


@pytest.mark.parametrize("name", [n for n, f in MESSAGES_FIELDS.items() if f.fate == "ignored"])
def test_each_ignored_field_leaves_the_request_as_it_was(name):
    assert chat_body(BASE | {name: {"anything": 1}}) == chat_body(BASE)


def test_each_implemented_field_reaches_the_chat_body():
    body = BASE | {"system": "s", "stop_sequences": ["x"], "temperature": 0.1, "top_p": 0.5, "top_k": 3,
                   "stream": False, "tools": [WEATHER], "tool_choice": {"type": "auto"},
                   "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                   "thinking": {"type": "disabled"}}
    implemented = {n for n, f in MESSAGES_FIELDS.items() if f.fate == "implemented"}
    assert implemented == set(body)
    chat = chat_body(body)
    assert set(chat) == {"model", "max_tokens", "messages", "stop", "temperature", "top_p", "top_k", "stream",
                         "tools", "tool_choice", "response_format", "chat_template_kwargs"}


# ---------------------------------------------------------------------------------------- the chat route's fields

def test_the_chat_routes_own_fields_pass_through_and_its_spellings_of_messages_fields_do_not():
    from server.messages_fields import NOT_PASSED, PASSED_TO_CHAT

    assert {"min_p", "seed", "guided_grammar", "logit_bias", "chat_template_kwargs", "enable_thinking"} \
        <= PASSED_TO_CHAT
    assert not ({"stop", "n", "logprobs", "response_format", "max_tokens", "temperature"} & PASSED_TO_CHAT)
    assert set(NOT_PASSED).isdisjoint(MESSAGES_FIELDS)


def _with_chat_fields(extra: dict) -> dict:
    from server.messages_fields import with_chat_fields

    body = BASE | extra
    return with_chat_fields(body, chat_body(body), thinking_of(body))


def test_passed_fields_reach_the_chat_parser_and_template_variables_merge_with_thinking():
    chat = _with_chat_fields({"min_p": 0.1, "seed": 3, "thinking": {"type": "disabled"},
                              "chat_template_kwargs": {"tone": "dry"}})
    req = parse_chat(chat, MODEL)
    assert (req.sampling.params.min_p, req.sampling.params.seed) == (0.1, 3)
    assert req.template_kwargs == {"tone": "dry", "enable_thinking": False}
    assert parse_chat(_with_chat_fields({"enable_thinking": True}), MODEL).template_kwargs == {"enable_thinking": True}
    assert _with_chat_fields({"n": 1, "logprobs": False, "stream_options": {"include_usage": True}}) == chat_body(BASE)


@pytest.mark.parametrize("extra, param", [
    ({"stop": ["x"]}, "stop"), ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_completion_tokens": 5}, "max_completion_tokens"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"thinking": {"type": "disabled"}, "enable_thinking": True}, "thinking"),
    ({"thinking": {"type": "adaptive"}, "chat_template_kwargs": {"enable_thinking": False}}, "thinking")])
def test_chat_spellings_results_without_a_place_and_contradictions_are_refused(extra, param):
    with pytest.raises(MessagesError) as err:
        _with_chat_fields(extra)
    assert err.value.param == param and f"'{param}'" in str(err.value)


# ---------------------------------------------------------------------------------------- replies

META = MessageMeta("msg_1", MODEL)
HERMES = ToolCallOutput(HermesParser())


def _outputs(pieces: list[str], finish: str = "stop", stop: str | None = None, cached: int = 0
             ) -> list[RequestOutput]:
    """The outputs a stream of `pieces` (one token each) gives."""
    outs, text = [], ""
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        sample = CompletionOutput(0, text, list(range(i + 1)), finish if last else None, None, piece, [i],
                                  stop_reason=stop if last else None)
        outs.append(RequestOutput("r", None, list(range(10)), [sample], RequestMetrics(0.0), cached, last))
    return outs


def _events(outs: list[RequestOutput], tools: ToolCallOutput | None, reasoning: ReasoningOutput | None = None,
            shown: bool = True) -> list[tuple[str, dict]]:
    builder = MessageEvents(META, tools, reasoning, shown)
    events = builder.opening(outs[0])
    for out in outs:
        events += builder.events(out)
    return events + builder.closing(outs[-1])


def check_event_order(names: list[str]) -> None:
    """message_start, then blocks of content_block_start, deltas, content_block_stop, then message_delta and
    message_stop."""
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    inside = False
    for name in names[1:-2]:
        if name == "content_block_start":
            assert not inside, names
            inside = True
        elif name in ("content_block_delta", "content_block_stop"):
            assert inside, names
            inside = name == "content_block_delta"
        else:
            raise AssertionError(f"unexpected event {name} in {names}")
    assert not inside, names


CALL = ["Sure. ", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Oslo"}}', "\n</tool_call>"]


def test_a_streamed_call_is_a_text_block_then_a_tool_use_block_in_order():
    outs = _outputs(CALL)
    events = _events(outs, HERMES)
    check_event_order([name for name, _ in events])
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    deltas = [data for name, data in events if name == "content_block_delta"]
    text = "".join(d["delta"]["text"] for d in deltas if d["delta"]["type"] == "text_delta")
    arguments = "".join(d["delta"]["partial_json"] for d in deltas if d["delta"]["type"] == "input_json_delta")
    assert {d["index"] for d in deltas if d["delta"]["type"] == "input_json_delta"} == {1}
    whole = message_body(META, outs[-1], HERMES)
    assert whole["content"] == [{"type": "text", "text": text},
                                {"type": "tool_use", "id": whole["content"][1]["id"], "name": "get_weather",
                                 "input": json.loads(arguments)}]
    assert json.loads(arguments) == {"city": "Oslo"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} == {
        "stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]}


def test_a_whole_reply_cut_inside_a_second_call_keeps_the_first_call():
    second = ['<tool_call>', '\n{"name": "get_weather", ', '"arguments": {"ci']
    whole = message_body(META, _outputs(CALL + second, finish="length")[-1], HERMES)
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Oslo"} and whole["stop_reason"] == "max_tokens"


def test_plain_text_streams_as_one_text_block_that_joins_to_the_whole_reply():
    outs = _outputs(["Hel", "lo", " there"], finish="length", cached=4)
    events = _events(outs, None)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                            "content_block_delta", "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    whole = message_body(META, outs[-1], None)
    assert whole["content"] == [{"type": "text", "text": text}] and text == "Hello there"
    assert whole["stop_reason"] == events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    usage = {"input_tokens": 6, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4}
    assert whole["usage"] == events[-2][1]["usage"] == usage
    assert events[0][1]["message"]["usage"] == usage | {"output_tokens": 0}


QWEN3 = ReasoningOutput(ReasoningParser(ReasoningFormat.QWEN3), Start.OPEN)
THOUGHT = ["<think>", "Weather", " means a call.", "</think>", "\n\n"]


def test_thinking_streams_as_a_thinking_block_first_in_anthropics_order():
    outs = _outputs(THOUGHT + CALL)
    events = _events(outs, HERMES, QWEN3)
    check_event_order([name for name, _ in events])
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [data for name, data in events if name == "content_block_delta"]
    kinds = [(d["index"], d["delta"]["type"]) for d in deltas]
    assert kinds[:3] == [(0, "thinking_delta"), (0, "thinking_delta"), (0, "signature_delta")]
    thought = "".join(d["delta"]["thinking"] for d in deltas if d["delta"]["type"] == "thinking_delta")
    whole = message_body(META, outs[-1], HERMES, QWEN3)
    assert whole["content"][0] == {"type": "thinking", "thinking": thought, "signature": ""}
    assert thought == "Weather means a call."
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][1]["text"] == "Sure. " and whole["stop_reason"] == "tool_use"


def test_omitted_thinking_keeps_its_block_without_the_text():
    outs = _outputs(THOUGHT + ["Fine."])
    events = _events(outs, None, QWEN3, shown=False)
    assert [d["delta"]["type"] for name, d in events if name == "content_block_delta"] == [
        "signature_delta", "text_delta"]
    assert message_body(META, outs[-1], None, QWEN3, shown=False)["content"] == [
        {"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "Fine."}]


def test_a_model_that_did_not_think_has_no_thinking_block():
    outs = _outputs(["Fine."])
    assert [b["type"] for b in message_body(META, outs[-1], None, QWEN3)["content"]] == ["text"]
    assert "thinking" not in json.dumps(_events(outs, None, QWEN3))


def test_the_events_validate_against_the_anthropic_clients_types():
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(RawMessageStreamEvent)
    for _, data in _events(_outputs(THOUGHT + CALL), HERMES, QWEN3):
        assert adapter.validate_python(data).model_dump(exclude_none=True, exclude_unset=True)["type"] == data["type"]


def test_an_empty_reply_has_no_content_block():
    events = _events(_outputs([""]), None)
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]


def test_blanks_before_a_calls_input_are_not_sent_alone():
    pieces = ['<tool_call>\n{"name": "f", "arguments": ', " ", '{"a": 1}}', "\n</tool_call>"]
    deltas = [d["delta"]["partial_json"] for name, d in _events(_outputs(pieces), HERMES)
              if name == "content_block_delta"]
    assert deltas and not deltas[0][0].isspace()
    assert json.loads("".join(deltas)) == {"a": 1}


@pytest.mark.parametrize("finish,stop,called,expected", [
    ("stop", None, False, ("end_turn", None)),
    ("stop", None, True, ("tool_use", None)),
    ("stop", "END", False, ("stop_sequence", "END")),
    ("length", None, True, ("max_tokens", None)),
])
def test_stop_reasons(finish, stop, called, expected):
    assert stop_reason(CompletionOutput(0, finish_reason=finish, stop_reason=stop), called) == expected


def test_events_are_named_server_sent_events():
    encoded = encode_events([("message_stop", {"type": "message_stop"})])
    assert encoded == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def test_the_reply_id_is_the_request_ids_random_part():
    assert message_id("req-0123abcd") == "msg_0123abcd"


# ---------------------------------------------------------------------------------------- errors

def test_errors_take_anthropics_shape_and_the_messages_field_names():
    err = anthropic_error(ApiError(400, "'stop' may hold at most 16 sequences, got 20.", "stop", "invalid_value"))
    assert err.param == "stop_sequences" and err.status == 400
    assert err.body() == {"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": "'stop_sequences' may hold at most 16 sequences, "
                                                                "got 20."}}
    kinds = {status: anthropic_error(ApiError(status, "m")).body()["error"]["type"]
             for status in (401, 404, 413, 429, 500, 503)}
    assert kinds == {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                     429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


# ---------------------------------------------------------------------------------------- fuzzing

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3), max_leaves=8)
FIELDS = sorted(MESSAGES_FIELDS) + ["messages[0]", "content", "block", "tool", "thinking.type",
                                    "thinking.budget_tokens", "thinking.display"]
VALID = BASE | {"system": "s", "tools": [WEATHER], "tool_choice": {"type": "auto"}, "stop_sequences": ["x"],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


def _mutated(field: str, value) -> dict:
    body = json.loads(json.dumps(VALID))
    if field == "messages[0]":
        body["messages"][0] = value
    elif field == "content":
        body["messages"][0]["content"] = value
    elif field == "block":
        body["messages"][0]["content"][0] = value
    elif field == "tool":
        body["tools"][0] = value
    elif field.startswith("thinking."):
        body["thinking"] = {"type": "enabled", "budget_tokens": 64, field.split(".")[1]: value}
    else:
        body[field] = value
    return body


def _translated_or_refused(body: dict) -> None:
    """The body runs through the translation and the chat route's parser, or is refused as a 4xx naming a
    field: nothing else may come out."""
    try:
        parse_chat(chat_body(body), MODEL)
        thinking_of(body)
    except MessagesError as exc:
        assert f"'{exc.param}'" in str(exc)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and anthropic_error(exc).body()["error"]["message"]


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS), JSON)
def test_fuzzed_fields_are_translated_or_refused_as_4xx(field, value):
    _translated_or_refused(_mutated(field, value))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(sorted(MESSAGES_FIELDS)), JSON, max_size=6))
def test_fuzzed_bodies_are_translated_or_refused_as_4xx(body):
    _translated_or_refused(body)
