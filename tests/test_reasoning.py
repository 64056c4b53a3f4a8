"""The reasoning parser (frontend/reasoning.py): thinking told from the answer, whole and streamed in every split
(tags cut across deltas), where the prompt leaves the output; the parser chosen from the template and the
vocabulary; constraints moved past the thinking (checked on the compiled grammar); and LLM.chat on tiny models
whose tokenizers have `<think>` tokens and whose templates use them."""
from __future__ import annotations

import json

import pytest

from engine.sampling.structured import Guide, GrammarCompiler
from frontend.output import ReasoningOutput, ReasoningText, ReplyStream, ToolCallOutput, read_reply
from frontend.reasoning import (ReasoningFormat, ReasoningParser, ReasoningStream, Start, choose_parser,
                                split_reasoning, think_first)
from frontend.tool_format import ToolFormat
from frontend.tool_grammar import forced_guide
from frontend.tool_parsers import HermesParser
from frontend.tool_stream import ArgumentsText, CallOpened, ContentText
from frontend.tools import ToolChoice, parse_tools
from tests.tiny_tokenizer import CHATML_TEMPLATE, QWEN3_TEMPLATE, R1_TEMPLATE, THINK_TOKENS

QWEN3 = ReasoningParser(ReasoningFormat.QWEN3)
R1 = ReasoningParser(ReasoningFormat.DEEPSEEK_R1)


def streamed(text: str, parser: ReasoningParser, start: Start, cuts: list[int]) -> tuple[str | None, str]:
    """`text` fed in pieces cut at `cuts`: (the reasoning the stream holds, the answer its deltas add up to)."""
    stream, answer = ReasoningStream(parser, start), ""
    bounds = [0, *cuts, len(text)]
    joined = ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        thought, said = stream.feed(text[a:b], finished=i == len(bounds) - 2)
        joined += thought
        answer += said
    assert joined == (stream.reasoning or "")
    return stream.reasoning, answer


CASES = [  # (text, parser, start, reasoning, answer)
    ("<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", QWEN3, Start.OPEN, "\nLet me see: 2 < 3.\n", "Yes."),
    ("  <think>a</think>b", QWEN3, Start.OPEN, "a", "b"),
    ("No thinking at all, <think> here is text.", QWEN3, Start.OPEN, None, "No thinking at all, <think> here is text."),
    ("<thinking> is not the tag", QWEN3, Start.OPEN, None, "<thinking> is not the tag"),
    ("<think>cut off before it closed", QWEN3, Start.OPEN, "cut off before it closed", ""),
    ("opened by the prompt</think>\n\nAnswer </think> kept", QWEN3, Start.THINKING, "opened by the prompt",
     "Answer </think> kept"),
    ("never opened</think>Answer", R1, Start.OPEN, "never opened", "Answer"),
    ("<think>opened anyway</think>Answer", R1, Start.OPEN, "opened anyway", "Answer"),
    ("all thinking, no close", R1, Start.OPEN, "all thinking, no close", ""),
    ("<think>x</think>thinking was off", QWEN3, Start.ANSWER, None, "<think>x</think>thinking was off"),
    ("<think></think>\n\n", QWEN3, Start.OPEN, "", ""),
    ("\n  indented answer, no thinking", QWEN3, Start.OPEN, None, "\n  indented answer, no thinking"),
]


@pytest.mark.parametrize("text,parser,start,reasoning,answer", CASES)
def test_split_reasoning(text, parser, start, reasoning, answer):
    assert split_reasoning(text, parser, start) == (reasoning, answer)


@pytest.mark.parametrize("text,parser,start,reasoning,answer", CASES)
def test_every_split_of_the_stream_adds_up_to_the_whole(text, parser, start, reasoning, answer):
    for cut in range(len(text) + 1):
        assert streamed(text, parser, start, [cut]) == (reasoning, answer), cut
    assert streamed(text, parser, start, list(range(1, len(text)))) == (reasoning, answer)  # one char a time


def test_a_tag_cut_across_deltas_is_held_back_until_it_is_known():
    stream = ReasoningStream(QWEN3, Start.OPEN)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hmm </th") == ("Hmm ", "")
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("\nDone") == ("", "Done")
    not_a_tag = ReasoningStream(QWEN3, Start.OPEN)
    assert not_a_tag.feed("<thi") == ("", "")
    assert not_a_tag.feed("s is text") == ("", "<this is text")


# ---------------------------------------------------------------------------------------- choosing a parser

def test_the_parser_is_chosen_from_the_template_and_the_vocabulary():
    assert choose_parser("auto", CHATML_TEMPLATE, False) is None
    assert choose_parser("auto", QWEN3_TEMPLATE, True, "...assistant\n").format is ReasoningFormat.QWEN3
    assert choose_parser("auto", CHATML_TEMPLATE, True, "...assistant\n").format is ReasoningFormat.QWEN3
    assert choose_parser("auto", R1_TEMPLATE, True, "...assistant\n<think>\n").format is ReasoningFormat.DEEPSEEK_R1
    assert choose_parser("none", QWEN3_TEMPLATE, True) is None
    assert choose_parser("deepseek_r1", CHATML_TEMPLATE, False).format is ReasoningFormat.DEEPSEEK_R1
    with pytest.raises(ValueError, match="reasoning parser 'o1'"):
        choose_parser("o1", None, False)


def test_where_the_output_starts_follows_the_prompt():
    assert QWEN3.start("<|im_start|>assistant\n<think>\n") is Start.THINKING
    assert QWEN3.start("<|im_start|>assistant\n<think>\n\n</think>\n\n") is Start.ANSWER
    assert QWEN3.start("<|im_start|>assistant\n") is Start.OPEN
    assert QWEN3.start(None) is Start.OPEN


# ---------------------------------------------------------------------------------------- with tool calls

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = ToolCallOutput(HermesParser())


def test_tool_calls_are_read_from_the_answer_not_the_thinking():
    text = f"<think>Maybe {CALL}? No: later.</think>\n\nCalling.{CALL}"
    reply = read_reply(text, "stop", TOOLS, ReasoningOutput(QWEN3, Start.OPEN))
    assert reply.reasoning == f"Maybe {CALL}? No: later." and reply.content == "Calling."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("add", {"a": 1, "b": 2})]
    for step in (1, 4, 1000):
        stream = ReplyStream(TOOLS, ReasoningOutput(QWEN3, Start.OPEN))
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        events = [e for i, p in enumerate(pieces) for e in stream.feed(p, i == len(pieces) - 1)]
        assert "".join(e.text for e in events if isinstance(e, ReasoningText)) == reply.reasoning
        assert "".join(e.text for e in events if isinstance(e, ContentText)) == reply.content
        assert [e.name for e in events if isinstance(e, CallOpened)] == ["add"]
        assert [json.loads(e.text) for e in events if isinstance(e, ArgumentsText)] == [{"a": 1, "b": 2}]
        assert stream.called


def test_a_reply_cut_while_thinking_is_all_reasoning():
    reply = read_reply("<think>still going", "length", TOOLS, ReasoningOutput(QWEN3, Start.OPEN))
    assert (reply.reasoning, reply.content, reply.tool_calls) == ("still going", None, [])
    plain = read_reply("<think>still going", "length", None, ReasoningOutput(QWEN3, Start.OPEN))
    assert (plain.reasoning, plain.content) == ("still going", None)


# ---------------------------------------------------------------------------------------- constraints

@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer has `<think>` and `</think>` tokens and whose template is Qwen3's."""
    from tests.tiny_models import tiny_llama_config, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-thinking"), tiny_llama_config(), seed=7,
                            template=QWEN3_TEMPLATE, added_tokens=THINK_TOKENS)


@pytest.fixture(scope="module")
def compiler(thinking_dir):
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_folder(thinking_dir)
    return tokenizer, GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids)


def accepts(compiler, guide: Guide, text: str) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.matcher(guide)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.accept_token(tokenizer.eos_token_ids[0])


SCHEMA = Guide.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


@pytest.mark.engine
def test_a_constraint_applies_after_free_thinking(compiler):
    maybe = think_first(SCHEMA, QWEN3, Start.OPEN)
    assert accepts(compiler, maybe, '<think>\nIs {"n": x} right? Not JSON at all.\n</think>\n\n{"n": 3}')
    assert accepts(compiler, maybe, '{"n": 3}')  # the output may skip the thinking
    assert not accepts(compiler, maybe, '<think>fine</think>\n\nnot json')
    assert not accepts(compiler, maybe, 'not json')
    opened = think_first(SCHEMA, QWEN3, Start.THINKING)
    assert accepts(compiler, opened, 'the prompt opened it</think>{"n": 3}')
    assert not accepts(compiler, opened, '{"n": 3}')  # the block must close first
    assert accepts(compiler, think_first(SCHEMA, R1, Start.OPEN), '<think>x</think>\n{"n": 1}')
    assert think_first(SCHEMA, QWEN3, Start.ANSWER) == SCHEMA  # thinking off: the constraint as it is


@pytest.mark.engine
def test_every_kind_of_constraint_and_a_forced_call_follow_the_thinking(compiler):
    for guide, answer in [(Guide("regex", "[a-c]{2}"), "ab"), (Guide("choice", choices=("yes", "no")), "no"),
                          (Guide("json_object"), '{"k": [1]}'), (Guide("grammar", 'root ::= "ok"'), "ok")]:
        wrapped = think_first(guide, QWEN3, Start.OPEN)
        assert accepts(compiler, wrapped, f"<think>hmm</think>\n{answer}"), guide
        assert not accepts(compiler, wrapped, "<think>hmm</think>\nzzz"), guide
    tools = parse_tools([{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}])
    call = think_first(forced_guide(ToolFormat.HERMES, tools, ToolChoice("required"), False), QWEN3, Start.OPEN)
    assert accepts(compiler, call, f"<think>I should add.</think>\n\n{CALL}")
    assert not accepts(compiler, call, "<think>I should add.</think>\n\nI will not.")


@pytest.mark.engine
def test_a_grammar_that_spells_the_tags_is_left_whole():
    grammar = Guide("grammar", 'root ::= "<think>" [a-z]+ "</think>" "42"')
    assert think_first(grammar, QWEN3, Start.OPEN) == grammar


# ---------------------------------------------------------------------------------------- LLM.chat

@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory):
    """A tiny Llama with think tokens and DeepSeek-R1's template, whose generation prompt opens the block."""
    from tests.tiny_models import tiny_llama_config, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-r1"), tiny_llama_config(), seed=7,
                            template=R1_TEMPLATE, added_tokens=THINK_TOKENS)


@pytest.mark.engine
def test_llm_chat_splits_a_forced_r1_output(r1_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(r1_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    assert llm.front_door.reasoning.format is ReasoningFormat.DEEPSEEK_R1  # auto: the template opens the block
    forced = Guide("grammar", 'root ::= "Two and two" "</think>" "\\n\\n" "Four."')
    out = llm.chat([{"role": "user", "content": "2+2?"}], SamplingParams(max_tokens=30, guide=forced))[0].outputs[0]
    assert out.text == "Two and two</think>\n\nFour."
    assert (out.reasoning_content, out.content, out.tool_calls) == ("Two and two", "Four.", None)


@pytest.mark.engine
def test_llm_chat_passes_enable_thinking_to_the_template(thinking_dir):
    from engine import LLM, SamplingParams

    llm = LLM(str(thinking_dir), dtype="float32", num_kv_blocks=64, block_size=8)
    assert llm.front_door.reasoning.format is ReasoningFormat.QWEN3
    ask = [{"role": "user", "content": "Hi"}]
    assert llm.front_door.chat(ask, template_kwargs={"enable_thinking": False}).prompt.endswith(
        "<think>\n\n</think>\n\n")
    params = SamplingParams(max_tokens=30, guide=Guide("choice", choices=("Hello",)))
    off = llm.chat(ask, params, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert (off.reasoning_content, off.content) == (None, "Hello")
    forced = Guide("grammar", 'root ::= "<think>" "Greet back." "</think>" "\\n\\n" "Hello"')
    on = llm.chat(ask, SamplingParams(max_tokens=30, guide=forced))[0].outputs[0]
    assert (on.reasoning_content, on.content) == ("Greet back.", "Hello")
    with pytest.raises(ValueError, match="'messages' is set by the server"):
        llm.chat(ask, params, chat_template_kwargs={"messages": []})
