"""A reasoning model through the real server and the official openai client: a tiny random model whose tokenizer
has `<think>` and `</think>` tokens and whose chat template is Qwen3's (enable_thinking). The random model
cannot think by itself, so its output is forced with a grammar that spells the tags (such a grammar constrains
the whole output), and the reply must split it: `reasoning_content` and `content`, whole and streamed."""
from __future__ import annotations

import json

import openai
import pytest

from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server
from tests.test_tool_calls_api import WEATHER, check_arguments
from tests.tiny_models import tiny_llama_config, write_tiny_model
from tests.tiny_tokenizer import QWEN3_TEMPLATE, THINK_TOKENS

MODEL = "tiny-thinking"
ASK = [{"role": "user", "content": "Hi"}]
FORCED = 'root ::= "<think>" "Greet back, briefly." "</think>" "\\n\\n" "Hello there."'
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-thinking"),
                              tiny_llama_config(num_key_value_heads=2, max_position_embeddings=1024), seed=7,
                              template=QWEN3_TEMPLATE, added_tokens=THINK_TOKENS)
    proc = start_server(tmp_path_factory.mktemp("thinking") / "server.log", "--model", str(folder),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 60, "temperature": 0,
                                                          **kwargs})


def test_the_parser_is_chosen_from_the_template(server):
    assert server.get("/v1/models").json()["data"][0]["defaults"]["reasoning_parser"] == "qwen3"


def test_a_reply_splits_reasoning_from_content(client):
    choice = _chat(client, extra_body={"guided_grammar": FORCED}).choices[0]
    assert choice.finish_reason == "stop"
    assert (choice.message.reasoning_content, choice.message.content) == ("Greet back, briefly.", "Hello there.")


def test_streamed_deltas_add_up_to_the_same_split(client):
    chunks = [c.choices[0] for c in _chat(client, stream=True, extra_body={"guided_grammar": FORCED}) if c.choices]
    deltas = [c.delta.model_dump(exclude_none=True) for c in chunks]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == ("Greet back, briefly.", "Hello there.")
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, reverse=True)  # all the reasoning first, then the answer
    assert chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("extra", [THINKING_OFF, {"enable_thinking": False}], ids=["chat_template_kwargs", "field"])
def test_enable_thinking_reaches_the_template(client, server, extra):
    on = _chat(client, max_tokens=4, extra_body={"ignore_eos": True})
    off = _chat(client, max_tokens=4, extra_body={"ignore_eos": True, **extra})
    block = server.post("/tokenize", {"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False}).json()
    tokenized = server.post("/tokenize", {"messages": ASK, **extra}).json()
    # With thinking off, the template writes an empty think block into the prompt.
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + block["count"] == tokenized["count"]
    answer = _chat(client, extra_body={"guided_grammar": 'root ::= "Hello."', **extra}).choices[0].message
    assert (answer.reasoning_content, answer.content) == (None, "Hello.")  # the prompt closed the block


def test_a_forced_call_with_thinking_off_is_read_from_the_answer(client):
    choice = _chat(client, max_tokens=200, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   extra_body=THINKING_OFF).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content is None
    check_arguments(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)


def test_a_json_schema_applies_to_the_answer_after_the_thinking(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    # The tags favoured so that the random model opens and closes its block; what it thinks is free text.
    choice = _chat(client, max_tokens=100, response_format=fmt, logit_bias={"510": 3, "511": 3}).choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.reasoning_content, str)
    assert type(json.loads(choice.message.content)["n"]) is int


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"enable_thinking": "yes"}, "enable_thinking"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
])
def test_bad_template_variables_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body


def test_thinking_off_on_the_other_routes_reaches_the_template(client, server):
    """Messages' thinking disabled and Responses' reasoning effort none write the empty think block too."""
    off = server.post("/tokenize", {"messages": ASK, **THINKING_OFF}).json()["count"]
    on = server.post("/tokenize", {"messages": ASK}).json()["count"]
    counted = server.post("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK,
                                                        "thinking": {"type": "disabled"}}).json()
    assert counted["input_tokens"] == off > on
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, reasoning={"effort": "none"})
    assert response.usage.input_tokens == off and response.reasoning.effort == "none"
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).usage.input_tokens == on


def test_the_usage_counts_the_thinking_tokens_whole_and_streamed(client):
    whole = _chat(client, extra_body={"guided_grammar": FORCED})
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True},
                        extra_body={"guided_grammar": FORCED}))
    thought = whole.usage.completion_tokens_details.reasoning_tokens
    assert thought == chunks[-1].usage.completion_tokens_details.reasoning_tokens
    # "<think>", the thinking and "</think>" are counted; the blank line and the answer are not.
    assert 2 < thought < whole.usage.completion_tokens
    plain = _chat(client, extra_body={"guided_grammar": 'root ::= "Hello."'})
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_messages_split_the_thinking_into_its_block_with_the_chat_routes_grammar(server):
    """The chat route's own fields pass through /v1/messages: a grammar forces the thinking here."""
    import anthropic

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    ask = dict(model=MODEL, max_tokens=60, messages=ASK, thinking={"type": "adaptive"},
               extra_body={"temperature": 0, "guided_grammar": FORCED})
    whole = claude.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "Greet back, briefly."), ("text", "Hello there.")]
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [
        b.model_dump(exclude={"parsed_output"}) for b in whole.content]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(**ask | {"thinking": {"type": "disabled"},
                                        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}})
    assert "'thinking'" in err.value.body["error"]["message"]
