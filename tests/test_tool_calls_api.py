"""Tool calls, echo, suffix, best_of, the field table, defaults and 404s through the real server (a decode
actor), driven by the official openai client. The tiny random model cannot choose a tool on its own, so
the forced modes (a named function, "required") are where its calls are checked against the schema."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server
from tests.tiny_models import tiny_llama_config, write_tiny_model

MODEL = "tiny-tools"
DEFAULT_MAX_TOKENS = 24
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "b": {"type": "integer", "minimum": -99, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_arguments(name: str, arguments: str) -> None:
    """The schemas above, checked by hand (jsonschema is not a dependency)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"}, args
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
        assert type(args["days"]) is int and 1 <= args["days"] <= 7
    else:
        assert name == "add" and set(args) == {"a", "b"}, (name, args)
        assert all(type(v) is int and -99 <= v <= 99 for v in args.values())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model with room for the tools' system message, and a generation_config.json of its own."""
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-tools"),
                              tiny_llama_config(num_key_value_heads=2, max_position_embeddings=4096), seed=7)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("tools") / "server.log", "--model", str(model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL,
                        "--default-max-tokens", str(DEFAULT_MAX_TOKENS))
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 300, **kwargs})


# ---------------------------------------------------------------------------------------- forced calls

@pytest.mark.parametrize("seed", range(3))
def test_a_named_tool_returns_a_call_whose_arguments_follow_the_schema(client, seed):
    r = _chat(client, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    check_arguments(call.function.name, call.function.arguments)


@pytest.mark.parametrize("seed", range(3))
def test_required_returns_calls_of_offered_tools(client, seed):
    r = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    for call in choice.message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)


def _stream_calls(client, **kwargs):
    """(content, {index: [id, name, arguments]}, finish_reason) added up from the stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.name  # the first delta names it
                calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_calls_add_up_to_arguments_that_follow_the_schema(client, choice):
    content, calls, finish = _stream_calls(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                           temperature=1.0, seed=11)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    call_id, name, arguments = calls[0]
    assert name == "get_weather" or choice == "required"
    check_arguments(name, arguments)
    whole = _chat(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=11)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(arguments)


def test_parallel_required_calls_each_follow_their_schema(client):
    """Every parsed call validates, whether the sampler stopped after its calls or chained calls until the
    budget ran out; among a few seeds at least one ends with finish_reason "tool_calls"."""
    ended = []
    for seed in range(5, 10):
        choice = _chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                       max_tokens=600).choices[0]
        for call in choice.message.tool_calls or []:
            check_arguments(call.function.name, call.function.arguments)
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls
            ended.append(seed)
            break
    assert ended


# ---------------------------------------------------------------------------------------- conversation

def _round_trip(result: str) -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result}]


def test_a_tool_result_round_trip_answers(client):
    short = _chat(client, messages=_round_trip("sunny"), tools=TOOLS, max_tokens=8, temperature=0)
    long = _chat(client, messages=_round_trip("sunny, 21 degrees, light wind from the west"), tools=TOOLS,
                 max_tokens=8, temperature=0)
    assert short.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert long.usage.prompt_tokens > short.usage.prompt_tokens  # the tool's result is in the prompt
    without_call = _chat(client, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0)
    assert short.usage.prompt_tokens > without_call.usage.prompt_tokens  # and so is the earlier call


def test_tool_choice_none_never_parses_calls(client):
    r = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=16, temperature=1.0, seed=3)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    assert isinstance(r.choices[0].message.content, str)


@pytest.mark.parametrize("kwargs,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="required"), "tools"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param, err.value.body


# ---------------------------------------------------------------------------------------- completions extras

def test_echo_returns_the_prompt_before_the_completion(client, server, model_dir):
    from tokenizers import Tokenizer

    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                         echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    ids = [40, 41, 42]
    text = Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    out = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2, "echo": True}).json()
    assert out["choices"][0]["text"].startswith(text) and len(out["choices"][0]["text"]) > len(text)


def test_suffix_without_fim_tokens_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="def f(", suffix="return x", max_tokens=4)
    assert err.value.body["param"] == "suffix" and "fill-in-the-middle" in err.value.body["message"]


def test_echo_with_logprobs_puts_the_prompts_tokens_and_logprobs_first(client, server):
    ids = [40, 41, 42, 43, 44]
    ask = {"model": MODEL, "prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    plain = server.post("/v1/completions", ask).json()["choices"][0]["logprobs"]
    echoed = server.post("/v1/completions", ask | {"echo": True}).json()["choices"][0]["logprobs"]
    assert len(echoed["tokens"]) == len(ids) + 3 and echoed["tokens"][len(ids):] == plain["tokens"]
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    # the same logits, computed in a product of other rows (the prompt's are read too): equal to rounding
    assert echoed["token_logprobs"][len(ids):] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    assert all(lp <= 0 for lp in echoed["token_logprobs"][1:]) and all(
        len(top) >= 2 for top in echoed["top_logprobs"][1:])
    assert echoed["text_offset"][0] == 0 and echoed["text_offset"] == sorted(echoed["text_offset"])
    vllm = server.post("/v1/completions", ask | {"prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    assert [row[str(t)]["logprob"] for row, t in zip(vllm[1:], ids[1:])] == pytest.approx(
        echoed["token_logprobs"][1:len(ids)], abs=1e-5)
    assert all(row[str(t)]["rank"] >= 1 and row[str(t)]["decoded_token"] for row, t in zip(vllm[1:], ids[1:]))
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                         echo=True, stream=True, extra_body={"ignore_eos": True})
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == echoed["tokens"]


@pytest.fixture(scope="module")
def in_process_client(model_dir, tmp_path_factory):
    """best_of runs on an in-process engine: in actor mode a request of several samples with ignore_eos can
    stall before its last tokens whatever best_of does (n alone shows it), which is not this module's subject."""
    proc = start_server(tmp_path_factory.mktemp("tools-in-process") / "server.log", "--model", str(model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--in-process")
    yield openai_client(proc)
    assert proc.stop() == 0, proc.log()


def test_best_of_returns_the_likeliest_samples_and_bills_them_all(in_process_client):
    client = in_process_client
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=9, n=2,
                                  best_of=4, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]
    every = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=9, n=4,
                                      logprobs=0, extra_body={"ignore_eos": True})
    all_sums = sorted((sum(c.logprobs.token_logprobs) for c in every.choices), reverse=True)
    assert all_sums[0] > all_sums[-1]  # different samples, so the ranking is a real choice
    assert sums == pytest.approx(all_sums[:2])  # the same seed draws the same 4 samples
    assert r.usage.completion_tokens == 20
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=9,
                                      best_of=4, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None  # ranking needed logprobs; the client did not ask for them


# ---------------------------------------------------------------------------------------- fields, defaults, routes

@pytest.mark.parametrize("field,value", [("typical_p", 0.5), ("mirostat", 2), ("function_call", "auto"),
                                         ("use_beam_search", True)])
def test_refused_fields_are_400s_naming_them(server, field, value):
    result = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2, field: value})
    assert result.status == 400 and result.json()["error"]["param"] == field


def test_defaults_come_from_generation_config_and_the_max_tokens_flag(client, server):
    card = server.get("/v1/models").json()["data"][0]
    assert card["defaults"]["generation_config"] == {"temperature": 0.0, "top_k": 5}
    assert card["defaults"]["max_tokens"] == DEFAULT_MAX_TOKENS
    texts = {_chat(client, max_tokens=12, seed=s, extra_body={"ignore_eos": True}).choices[0].message.content
             for s in range(3)}
    assert len(texts) == 1  # temperature 0 from generation_config.json: the seed does not matter
    sampled = {_chat(client, max_tokens=12, seed=s, temperature=1.0,
                     extra_body={"ignore_eos": True, "top_k": -1}).choices[0].message.content for s in range(3)}
    assert len(sampled) > 1
    capped = client.chat.completions.create(model=MODEL, messages=ASK, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert "generation_config" in server.log() and "tool_call_parser" in server.log()  # the start-up line


def test_a_missing_route_is_a_404_with_a_sentence(server):
    result = server.post("/v1/audio/transcriptions", {"input": "x"})
    error = result.json()["error"]
    assert result.status == 404 and error["code"] == "not_found"
    assert "no route POST /v1/audio/transcriptions" in error["message"] and "/v1/chat/completions" in error["message"]
