"""JSON grammars that close (engine.sampling.json_grammar), checked through the engine's own compile path on the
tiny tokenizer: numbers bounded in digits, whitespace bounded between tokens, for json_schema, json_object and
a forced tool call's arguments, and wider only where the schema itself asks for it."""
from __future__ import annotations

import json

import pytest

from engine.model.tokenizer import Tokenizer
from engine.sampling.json_grammar import INTEGER_DIGITS, MAX_INDENT, bound_ebnf, json_schema_ebnf
from engine.sampling.structured import Guide, GrammarCompiler
from frontend.tool_format import ToolFormat
from frontend.tool_grammar import forced_guide
from frontend.tools import ToolChoice, parse_tools

CITY = Guide.json_schema({"type": "object", "properties": {"name": {"type": "string"},
                                                           "population": {"type": "integer"}},
                          "required": ["name", "population"], "additionalProperties": False})
NUMBER = Guide.json_schema({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
OBJECT = Guide("json_object")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    tokenizer = Tokenizer.from_hf_folder(tiny_model_dir)
    return tokenizer, GrammarCompiler(tokenizer, 512, tokenizer.eos_token_ids)


def accepts(compiler, guide: Guide, text: str) -> bool:
    """Whether `text` is a whole output the guide allows (the stop token accepted after it)."""
    tokenizer, grammars = compiler
    matcher = grammars.matcher(guide)
    return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_ids[0])


def city(population: str, ws: str = " ") -> str:
    return f'{{"name":{ws}"Oslo",{ws}"population":{ws}{population}}}'


def test_an_integer_has_at_most_sixteen_digits(compiler):
    assert INTEGER_DIGITS == 16
    assert accepts(compiler, CITY, city("1" * 16)) and accepts(compiler, CITY, city("-" + "9" * 16))
    assert not accepts(compiler, CITY, city("1" * 17))
    assert not accepts(compiler, CITY, city("-" + "9" * 17))
    assert accepts(compiler, CITY, city("0")) and not accepts(compiler, CITY, city("01"))


def test_a_number_is_bounded_in_its_integer_part_fraction_and_exponent(compiler):
    for ok in ("1" * 16, "0." + "5" * 16, "1.5e" + "1" * 16, "-2.25E+10"):
        assert accepts(compiler, NUMBER, f'{{"x": {ok}}}'), ok
    for bad in ("1" * 17, "0." + "5" * 17, "1e" + "1" * 17):
        assert not accepts(compiler, NUMBER, f'{{"x": {bad}}}'), bad


def test_json_object_numbers_are_bounded_at_any_depth(compiler):
    assert accepts(compiler, OBJECT, '{"a": [1, {"b": ' + "7" * 16 + "}]}")
    assert not accepts(compiler, OBJECT, '{"a": [1, {"b": ' + "7" * 17 + "}]}")
    assert not accepts(compiler, OBJECT, '{"a": 0.' + "3" * 17 + "}")


@pytest.mark.parametrize("guide", [CITY, OBJECT], ids=["json_schema", "json_object"])
def test_whitespace_is_nothing_a_space_or_one_newline_with_bounded_indentation(compiler, guide):
    assert accepts(compiler, guide, city("5", ws=""))
    assert accepts(compiler, guide, '{\n  "name": "Oslo",\n  "population": 5\n}')
    assert accepts(compiler, guide, '{\n\t"name":\n' + " " * MAX_INDENT + '"Oslo", "population": 5}')
    assert not accepts(compiler, guide, '{\n' + " " * (MAX_INDENT + 1) + '"name": "Oslo", "population": 5}')
    assert not accepts(compiler, guide, '{\n\n"name": "Oslo", "population": 5}')  # two newlines
    assert not accepts(compiler, guide, city("5", ws="  "))  # two spaces
    assert not accepts(compiler, guide, '{"name": "Oslo" \n"population": 5}')


def test_a_schema_that_asks_for_wider_gets_it(compiler):
    huge = Guide.json_schema({"type": "integer", "minimum": 0, "maximum": 10 ** 18})  # 19 digits
    assert accepts(compiler, huge, "9" * 18) and accepts(compiler, huge, str(10 ** 18))
    assert not accepts(compiler, huge, str(10 ** 18 + 1))
    digits = Guide.json_schema({"type": "string", "pattern": "^[0-9]*$"})
    assert accepts(compiler, digits, '"' + "4" * 40 + '"')
    half_open = Guide.json_schema({"type": "integer", "minimum": 0})  # open above: bounded there
    assert accepts(compiler, half_open, "8" * 16) and not accepts(compiler, half_open, "8" * 17)


def test_property_names_and_patterns_pass_through_unchanged(compiler):
    odd = "[0-9]* [ \\n\\r\\t]* bounded_ws{0, -1}"
    guide = Guide.json_schema({"type": "object", "properties": {odd: {"type": "integer"}}, "required": [odd]})
    assert accepts(compiler, guide, json.dumps({odd: 12}))
    assert not accepts(compiler, guide, json.dumps({"[0-9]{0, 15}": 12}))


def test_bound_ebnf_refuses_a_grammar_that_already_names_its_rule():
    with pytest.raises(ValueError, match="bounded_ws"):
        bound_ebnf(json_schema_ebnf({"type": "object"}))


def test_forced_tool_call_arguments_are_bounded_too(compiler):
    tools = parse_tools([{"type": "function", "function": {"name": "census", "parameters": {
        "type": "object", "properties": {"people": {"type": "integer"}}, "required": ["people"]}}}])
    guide = forced_guide(ToolFormat.HERMES, tools, ToolChoice("required"), parallel=False)
    call = '<tool_call>\n{{"name": "census", "arguments": {{"people": {}}}}}\n</tool_call>'
    assert accepts(compiler, guide, call.format("3" * 16))
    assert not accepts(compiler, guide, call.format("3" * 17))
    assert not accepts(compiler, guide, call.format("3").replace('"people":', '"people":\n\n'))
