"""The table of request fields (server/request_fields.py) walked: every refused field, sent with its example
value, is a 400 naming it on each route it is refused on; its default values pass; the fields the issue
named are each implemented or refused; and the implemented aliases do what they alias."""
from __future__ import annotations

import pytest

from engine.sampling.fields import declared
from engine.sampling.sampling_params import SamplingParams
from server.errors import ApiError
from server.protocol import RequestDefaults, parse_chat, parse_completion
from server.request_fields import CHAT, COMPLETIONS, IGNORED, IMPLEMENTED, REFUSED, REQUEST_FIELDS, _joined, field_name

MESSAGES = [{"role": "user", "content": "hi"}]
REFUSED_ROUTES = [(key, route) for key, fate in REQUEST_FIELDS.items() if fate.fate == REFUSED
                  for route in fate.routes]
# The fields issue 24 found silently accepted, plus llama.cpp's: each must be implemented or refused.
NAMED_IN_THE_ISSUE = ("guided_json", "guided_choice", "guided_regex", "structured_outputs", "min_p", "typical_p",
                      "bad_words", "allowed_token_ids", "use_beam_search", "prompt_logprobs", "function_call",
                      "repeat_penalty", "grammar", "json_schema", "mirostat", "echo", "suffix", "best_of", "tools",
                      "tool_choice", "response_format", "logit_bias")


def parse(route: str, extra: dict):
    if route == CHAT:
        return parse_chat({"messages": MESSAGES, **extra}, "m")
    return parse_completion({"prompt": "hi", **extra}, "m")


@pytest.mark.parametrize("key,route", REFUSED_ROUTES, ids=[f"{k}-{r}" for k, r in REFUSED_ROUTES])
def test_each_refused_field_is_a_400_naming_it(key, route):
    name, fate = field_name(key), REQUEST_FIELDS[key]
    with pytest.raises(ApiError) as err:
        parse(route, {name: fate.example})
    assert err.value.status == 400 and err.value.param == name and err.value.code == "unsupported_parameter"
    assert fate.why in err.value.message


@pytest.mark.parametrize("key,route", REFUSED_ROUTES, ids=[f"{k}-{r}" for k, r in REFUSED_ROUTES])
def test_a_refused_field_left_out_or_null_passes(key, route):
    assert parse(route, {field_name(key): None}) == parse(route, {})  # null is the field left out


def test_every_field_the_issue_named_has_a_fate_that_acts():
    for name in NAMED_IN_THE_ISSUE:
        fates = [f.fate for k, f in REQUEST_FIELDS.items() if field_name(k) == name]
        assert fates and IGNORED not in fates, name
    assert all(f.fate in (IMPLEMENTED, REFUSED, IGNORED) and f.why for f in REQUEST_FIELDS.values())


def test_defaults_of_refused_fields_pass():
    for body in ({"typical_p": 1.0}, {"use_beam_search": False}, {"mirostat": 0}, {"function_call": "none"},
                 {"bad_words": []}, {"penalty_last_n": -1}, {"length_penalty": 1}):
        assert parse(COMPLETIONS, body) == parse(COMPLETIONS, {}), body  # the default is the field left out


def test_llama_cpp_aliases_set_the_same_fields():
    assert parse(COMPLETIONS, {"repeat_penalty": 1.3}).sampling.params.repetition_penalty == 1.3
    assert parse(COMPLETIONS, {"n_predict": 7}).sampling.params.max_tokens == 7
    with pytest.raises(ApiError) as err:
        parse(COMPLETIONS, {"repeat_penalty": 1.3, "repetition_penalty": 1.1})
    assert err.value.param == "repeat_penalty"


def test_each_declared_request_name_is_an_implemented_row_on_its_endpoints():
    names = [name for _, spec in declared(SamplingParams) for name in spec.names]
    assert len({n.name for n in names}) == len(names) > 20
    for name in names:
        fate = REQUEST_FIELDS[name.name]
        assert (fate.fate, fate.why, fate.routes) == (IMPLEMENTED, name.why, name.endpoints), name.name


def test_a_field_in_two_tables_is_refused():
    with pytest.raises(ValueError, match="declared twice: top_k"):
        _joined(dict(REQUEST_FIELDS), {"top_k": REQUEST_FIELDS["top_k"]})


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_every_declared_field_is_read_from_its_request_name(route):
    body = {"n": 2, "max_tokens": 9, "min_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 7,
            "min_p": 0.1, "stop": "x", "stop_token_ids": [3], "ignore_eos": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logit_bias": {"5": 1.5}, "truncate_prompt_tokens": 8}
    params = parse(route, body).sampling.params
    assert params == SamplingParams(n=2, max_tokens=9, min_tokens=1, temperature=0.5, top_p=0.9, top_k=4, seed=7,
                                    min_p=0.1, stop=("x",), stop_token_ids=(3,), ignore_eos=True,
                                    skip_special_tokens=False, include_stop_str_in_output=True,
                                    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                                    logit_bias={5: 1.5}, truncate_prompt_tokens=8)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("value,code", [(0, "invalid_value"), (-2, "invalid_value"), (1.5, "invalid_type"),
                                        ("8", "invalid_type")])
def test_a_bad_truncate_prompt_tokens_is_a_400_naming_it(route, value, code):
    with pytest.raises(ApiError) as err:
        parse(route, {"truncate_prompt_tokens": value})
    assert (err.value.status, err.value.param, err.value.code) == (400, "truncate_prompt_tokens", code)


def test_chat_names_max_completion_tokens_first():
    fields = parse(CHAT, {"max_completion_tokens": 3, "max_tokens": 5}).sampling
    assert fields.params.max_tokens == 3 and fields.param("max_tokens") == "max_completion_tokens"
    assert parse(COMPLETIONS, {"max_completion_tokens": 3}).sampling.params.max_tokens == 16  # chat's name only


def test_unknown_fields_are_ignored():
    assert parse(COMPLETIONS, {"some_future_field": 3}).sampling.params.max_tokens == 16


def test_defaults_fill_only_what_the_request_leaves_out():
    defaults = RequestDefaults(temperature=0.3, top_k=20, repetition_penalty=1.1, max_tokens=50)
    left_out = parse_chat({"messages": MESSAGES}, "m", defaults).sampling
    params = left_out.params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.3, 20, 1.1)
    assert params.max_tokens == 50 and left_out.max_tokens_capped
    given = parse_chat({"messages": MESSAGES, "temperature": 0.9, "max_tokens": 5}, "m", defaults).sampling
    assert given.params.temperature == 0.9 and given.params.max_tokens == 5 and not given.max_tokens_capped
    assert parse_completion({"prompt": "x"}, "m", defaults).sampling.params.max_tokens == 50


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"suffix": 5}, "suffix"),
])
def test_completion_extras_refuse_what_they_cannot_do(body, param):
    with pytest.raises(ApiError) as err:
        parse(COMPLETIONS, body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_prompt_logprobs_with_stream_is_a_400_naming_it(route):
    with pytest.raises(ApiError) as err:
        parse(route, {"prompt_logprobs": 1, "stream": True})
    assert err.value.status == 400 and err.value.param == "prompt_logprobs"


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs():
    echoed = parse(COMPLETIONS, {"echo": True, "logprobs": 3})
    assert echoed.sampling.params.prompt_logprobs == 3 and echoed.echo_logprobs == 3
    assert echoed.prompt_logprobs is None  # vLLM's field was not asked for: the response leaves it out
    both = parse(COMPLETIONS, {"echo": True, "logprobs": 2, "prompt_logprobs": 5})
    assert both.sampling.params.prompt_logprobs == 5 and (both.echo_logprobs, both.prompt_logprobs) == (2, 5)
    assert parse(COMPLETIONS, {"echo": True}).sampling.params.prompt_logprobs is None
    assert parse(CHAT, {"prompt_logprobs": 0}).prompt_logprobs == 0


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": "f"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_name_their_field(body, param):
    with pytest.raises(ApiError) as err:
        parse(CHAT, body)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[0].tool_calls[0]"),
])
def test_bad_tool_messages_name_their_field(message, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [message]}, "m")
    assert err.value.param == param
