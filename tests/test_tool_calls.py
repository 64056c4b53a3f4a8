"""Tool calling without a server (frontend/): the three output parsers (whole, and streamed in fragments as
the server spells them), tools and tool_choice validation, the forced-call grammars, prompt rendering, and
LLM.chat(..., tools=...)."""
from __future__ import annotations

import json

import pytest

from engine.sampling.structured import Guide
from frontend.tool_format import ToolFormat
from frontend.tool_grammar import forced_guide
from frontend.tool_parsers import HermesParser, Llama3Parser, MistralParser, parser_for
from frontend.tool_prompts import format_calls, tool_messages
from frontend.tool_stream import ToolCallReader
from frontend.tools import ToolChoice, ToolError, parse_tool_choice, parse_tools
from server.streaming import tool_deltas


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = parse_tools([WEATHER, ADD])

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"nested": "}]\\""}}}\n</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
MISTRAL = 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]'
CASES = [(HermesParser(), HERMES, "Let me check.", {"city": "Paris", "days": 3}, {"a": 1, "b": {"nested": '}]"'}}),
         (Llama3Parser(), LLAMA3, None, {"city": "Paris", "days": 3}, {"a": 1, "b": 2}),
         (MistralParser(), MISTRAL, "Sure ", {"city": "Paris", "days": 3}, {"a": 1, "b": 2})]


@pytest.mark.parametrize("parser,text,content,first,second", CASES, ids=lambda c: getattr(c, "name", None))
def test_each_format_parses_into_calls(parser, text, content, first, second):
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == first and json.loads(calls[1].arguments) == second
    assert len({c.id for c in calls}) == 2
    assert [c.name for c in parser.parse(text, parallel=False)[1]] == ["get_weather"]


def _streamed(parser, text: str, step: int, cut: bool = False, whole_calls: bool = False):
    """Feeds `text` in `step`-character fragments: (content, [(id, name, arguments)]) as a client adds them up.
    `cut`: the sample ended at max_tokens."""
    stream, content, calls = ToolCallReader(parser, whole_calls=whole_calls), "", {}
    chunks = [text[i:i + step] for i in range(0, len(text), step)]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        for delta in tool_deltas(stream.feed(chunk, finished=last, cut=cut and last)):
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] not in calls and call["type"] == "function" and call["function"]["name"]
                    calls[call["index"]] = [call["id"], call["function"]["name"], call["function"]["arguments"]]
                else:
                    assert set(call["function"]) == {"arguments"}  # later deltas carry fragments only
                    calls[call["index"]][2] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("whole_calls", [False, True], ids=["fragments", "whole_calls"])
@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("parser,text,content,first,second", CASES, ids=lambda c: getattr(c, "name", None))
def test_streamed_fragments_add_up_to_the_whole_parse(parser, text, content, first, second, step, whole_calls):
    got_content, calls = _streamed(parser, text, step, whole_calls=whole_calls)
    assert got_content == (content or "")
    assert [name for _, name, _ in calls] == ["get_weather", "add"]
    assert json.loads(calls[0][2]) == first and json.loads(calls[1][2]) == second


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), "Just text, with < and <tool but no call."),
    (Llama3Parser(), 'A plain answer {"not": "a call"}'),
    (MistralParser(), "No calls here [TOOL"),
])
def test_text_without_calls_is_content_streamed_or_not(parser, text):
    assert parser.parse(text) == (text, [])
    assert _streamed(parser, text, 1) == (text, [])


def test_a_possible_marker_is_held_back_until_it_is_known():
    stream = ToolCallReader(HermesParser())
    assert tool_deltas(stream.feed("Hi <tool_", finished=False)) == [{"content": "Hi "}]
    assert tool_deltas(stream.feed("x>", finished=True)) == [{"content": "<tool_x>"}]


@pytest.mark.parametrize("parser,text", [
    (HermesParser(), '<tool_call>\n{"name": "add", "arguments": {"a": 1'),  # cut off by max_tokens
    (Llama3Parser(), '{"name": "add", "parameters": {"a": '),
    (MistralParser(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": '),
    (HermesParser(), "<tool_call>\nnot json\n</tool_call>"),
])
def test_an_unfinished_or_malformed_call_leaves_the_text_as_content(parser, text):
    assert parser.parse(text) == (text, [])


# Each format's output cut by max_tokens inside its second call, and the first call's arguments.
CUT = [(HermesParser(), 'Checking.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', "Checking."),
       (Llama3Parser(), '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "param', None),
       (MistralParser(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_w', None)]


@pytest.mark.parametrize("parser,text,content", CUT, ids=lambda c: getattr(c, "name", None))
def test_an_output_cut_inside_a_call_keeps_the_calls_that_closed(parser, text, content):
    got_content, calls = parser.parse(text, cut=True)
    assert got_content == content
    assert [c.name for c in calls] == ["add"] and json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert parser.parse(text) == (text, [])  # not cut: the unfinished call is malformed output, kept as text


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize("parser,text,content", CUT, ids=lambda c: getattr(c, "name", None))
def test_a_whole_call_stream_cut_inside_a_call_sends_only_the_calls_that_closed(parser, text, content, step):
    got_content, calls = _streamed(parser, text, step, cut=True, whole_calls=True)
    assert got_content == (content or "")
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("parser", [HermesParser(), Llama3Parser(), MistralParser()], ids=lambda p: p.name)
def test_an_output_cut_inside_its_first_call_is_all_content(parser):
    whole = format_calls(parser.format, [{"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}])
    text = whole[:whole.rindex("2")]
    assert parser.parse(text, cut=True) == (text, [])
    assert _streamed(parser, text, 3, cut=True, whole_calls=True) == (text, [])


def test_a_call_is_streamed_in_fragments_or_whole_once_its_json_closes():
    start, rest = '<tool_call>\n{"name": "add", "arguments": {"a": 1', ', "b": 2}}'
    fragments = ToolCallReader(HermesParser())
    opened, part = fragments.feed(start, finished=False)
    assert (opened.name, part.text) == ("add", '{"a": 1')
    assert fragments.feed(rest, finished=False)[0].text == ', "b": 2}'
    whole = ToolCallReader(HermesParser(), whole_calls=True)
    assert whole.feed(start, finished=False) == []
    opened, arguments = whole.feed(rest, finished=False)
    assert (opened.index, opened.name) == (0, "add") and json.loads(arguments.text) == {"a": 1, "b": 2}
    assert whole.feed("\n</tool_call>", finished=True) == []


def test_a_call_without_arguments_has_an_empty_object_and_quoted_arguments_are_unwrapped():
    _, calls = HermesParser().parse('<tool_call>{"name": "ping"}</tool_call>')
    assert calls[0].arguments == "{}"
    _, calls = HermesParser().parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(calls[0].arguments) == {"a": 1}


def test_mistral_call_ids_are_nine_alphanumerics():
    _, calls = MistralParser().parse(MISTRAL)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


# ---------------------------------------------------------------------------------------- request validation

@pytest.mark.parametrize("tools,match", [
    ("nope", "array"),
    ([{"type": "retrieval"}], r"tools\[0\]"),
    ([{"type": "function"}], r"tools\[0\].function"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters"),
    ([ADD, ADD], "twice"),
])
def test_malformed_tools_are_refused_naming_tools(tools, match):
    with pytest.raises(ToolError, match=match) as err:
        parse_tools(tools)
    assert err.value.param == "tools"


def test_tool_choice_values():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("required", TOOLS) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) == ToolChoice("named", "add")
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}):
        with pytest.raises(ToolError) as err:
            parse_tool_choice(bad, TOOLS)
        assert err.value.param == "tool_choice"
    with pytest.raises(ToolError, match="no 'tools'"):
        parse_tool_choice("required", ())


def test_parser_choice_follows_the_template_then_the_architecture():
    assert parser_for("auto", "{% if tools %}<tool_call>{% endif %}", "llama").name == "hermes"
    assert parser_for("auto", "[TOOL_CALLS] {{ tools }}", "llama").name == "mistral"
    assert parser_for("auto", "<|python_tag|>{{ tools }}", "llama").name == "llama3"
    assert parser_for("auto", "{{ messages }}", "mistral").name == "mistral"
    assert parser_for("auto", None, "qwen2").name == "hermes"
    assert parser_for("llama3", "<tool_call>", "qwen2").name == "llama3"
    with pytest.raises(ValueError):
        parser_for("nonsense", None, None)


# ---------------------------------------------------------------------------------------- prompts

def test_a_template_without_tools_gets_them_as_a_system_message():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages, extra = tool_messages(history, TOOLS, ToolFormat.HERMES, native=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert HermesParser().parse(messages[2]["content"])[1][0].name == "get_weather"  # the call as the model spells it
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_a_template_with_tools_gets_them_natively_with_arguments_as_objects():
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    messages, extra = tool_messages(history, TOOLS, ToolFormat.HERMES, native=True)
    assert extra["tools"][1]["function"]["name"] == "add"
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


# ---------------------------------------------------------------------------------------- forced calls

@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from engine.sampling.structured import GrammarCompiler
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_folder(tiny_model_dir)
    return tokenizer, GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids)


def _accepts(compiler, guide: Guide, text: str) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.matcher(guide)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.accept_token(tokenizer.eos_token_ids[0])


@pytest.mark.engine
@pytest.mark.parametrize("parser", [HermesParser(), Llama3Parser(), MistralParser()], ids=lambda p: p.name)
def test_forced_grammars_take_exactly_the_parsers_format(compiler, parser):
    named = forced_guide(parser.format, TOOLS, ToolChoice("named", "add"), parallel=True)
    one_add = format_calls(parser.format, [{"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}])
    assert _accepts(compiler, named, one_add)
    assert parser.parse(one_add)[1][0].name == "add"
    bad_args = format_calls(parser.format, [{"function": {"name": "add", "arguments": '{"a": "x", "b": 2}'}}])
    assert not _accepts(compiler, named, bad_args)
    weather = format_calls(parser.format,
                           [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}])
    assert not _accepts(compiler, named, weather)  # another function than the named one
    required = forced_guide(parser.format, TOOLS, ToolChoice("required"), parallel=False)
    assert _accepts(compiler, required, weather) and not _accepts(compiler, required, "Hello")


# ---------------------------------------------------------------------------------------- the embedded client

def check_weather_args(arguments: str) -> None:
    """The WEATHER schema, checked by hand (jsonschema is not a dependency)."""
    args = json.loads(arguments)
    assert set(args) == {"city", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12
    assert type(args["days"]) is int and 1 <= args["days"] <= 7


@pytest.mark.engine
def test_llm_chat_with_a_named_tool_returns_parsed_calls(tiny_model_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed) for seed in range(3)]
    conversations = [[{"role": "user", "content": "Weather in Oslo?"}]] * 3
    outs = llm.chat(conversations, params, tools=[WEATHER, ADD],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for out in outs:
        sample = out.outputs[0]
        assert sample.finish_reason == "stop", sample.text
        assert [c.name for c in sample.tool_calls] == ["get_weather"]
        check_weather_args(sample.tool_calls[0].arguments)
    plain = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, temperature=0))
    assert plain[0].outputs[0].tool_calls is None
    with pytest.raises(ToolError):
        llm.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.engine
def test_async_llm_chat_with_a_named_tool_ends_with_parsed_calls(tiny_model_dir):
    """The stream carries the model's text; its last output holds the calls LLM.chat would return."""
    import asyncio

    from engine import LLM, AsyncLLM, SamplingParams

    named = {"type": "function", "function": {"name": "get_weather"}}
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]

    async def stream() -> list:
        llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8)
        try:
            return [out async for out in llm.chat(ask, params, tools=[WEATHER, ADD], tool_choice=named)]
        finally:
            await llm.aclose()

    outs = asyncio.run(stream())
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "stop"
    assert [c.name for c in last.tool_calls] == ["get_weather"]
    check_weather_args(last.tool_calls[0].arguments)
    assert all(o.outputs[0].tool_calls is None for o in outs[:-1])  # read once, from the whole text
    assert "".join(o.outputs[0].delta_text for o in outs) == last.text
    blocking = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8)
    same = blocking.chat(ask, params, tools=[WEATHER, ADD], tool_choice=named)[0].outputs[0]
    assert same.text == last.text and [c.arguments for c in same.tool_calls] == [c.arguments for c in last.tool_calls]
