"""A reasoning model on the Messages and Responses routes, through the real server and the official anthropic
and openai clients: a tiny random model whose tokenizer has `<think>` and `</think>` tokens and whose template is
DeepSeek-R1's (the generation prompt opens the think block, so every output starts thinking).

The random model never closes the block by itself, so the tests close it either with Anthropic's
`thinking.budget_tokens` (enforced: the close tag is forced once the budget is spent) or with a grammar that
spells the close tag (Responses passes the chat route's `guided_grammar`). Each reply must split the thinking
off, whole and streamed alike, in each API's own shape and order, and count it in the usage."""
from __future__ import annotations

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server
from tests.test_anthropic_messages import check_event_order
from tests.tiny_models import tiny_llama_config, write_tiny_model
from tests.tiny_tokenizer import R1_TEMPLATE, THINK_TOKENS

MODEL = "tiny-r1"
ASK = [{"role": "user", "content": "Hi"}]
FORCED = 'root ::= "Greet back." "</think>" "\\n\\n" "Hello there."'
ENABLED = {"type": "enabled", "budget_tokens": 5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-r1"),
                              tiny_llama_config(num_key_value_heads=2, max_position_embeddings=1024), seed=7,
                              template=R1_TEMPLATE, added_tokens=THINK_TOKENS)
    proc = start_server(tmp_path_factory.mktemp("r1") / "server.log", "--model", str(folder),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def chat(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _message(claude, **kwargs):
    # The client's create() no longer names temperature: sent as an extra field.
    return claude.messages.create(model=MODEL, max_tokens=16, **{"messages": ASK, "extra_body": {"temperature": 0},
                                                                 **kwargs})


# ---------------------------------------------------------------------------------------- Messages

def test_the_budget_ends_the_thinking_and_the_answer_follows(claude, chat):
    message = _message(claude, thinking=ENABLED)
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking" and message.content[0].signature == ""
    # The thinking is what the model writes in 5 tokens: the same as a chat reply cut at 5 tokens.
    cut = chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0).choices[0]
    assert message.content[0].thinking == cut.message.reasoning_content and cut.finish_reason == "length"
    assert kinds[1:] == ["text"] and message.content[1].text  # the answer after the forced close
    free = _message(claude, thinking={"type": "adaptive"})  # no budget: the model thinks to the limit
    assert [block.type for block in free.content] == ["thinking"] and free.stop_reason == "max_tokens"


def test_a_streamed_thinking_reply_is_the_whole_one_in_anthropics_event_order(claude):
    whole = _message(claude, thinking=ENABLED)
    events = list(_message(claude, thinking=ENABLED, stream=True))
    check_event_order([e.type for e in events])
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas if d.type != "text_delta"][-1] == "signature_delta"
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == whole.content[0].thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == whole.content[1].text
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0},
                                thinking=ENABLED) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in whole.content]
    assert final.content[0].signature == "" and final.usage.output_tokens == whole.usage.output_tokens


def test_omitted_thinking_comes_back_empty(claude):
    message = _message(claude, thinking=ENABLED | {"display": "omitted"})
    assert message.content[0].type == "thinking" and message.content[0].thinking == ""
    assert message.content[1].text == _message(claude, thinking=ENABLED).content[1].text


def test_an_earlier_turns_thinking_is_accepted_and_dropped(claude):
    first = _message(claude, thinking=ENABLED)
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": "And?"}]
    plain = ASK + [{"role": "assistant", "content": first.content[1].text}, {"role": "user", "content": "And?"}]
    counted = [claude.messages.count_tokens(model=MODEL, messages=m).input_tokens for m in (turns, plain)]
    assert counted[0] == counted[1]
    assert _message(claude, messages=turns, thinking=ENABLED).content[0].type == "thinking"


@pytest.mark.parametrize("thinking, param", [
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "enabled"}, "thinking.budget_tokens"), ({"type": "between_tools"}, "thinking.type"),
    ({"type": "adaptive", "effort": "high"}, "thinking.effort"), ({"type": "enabled", "budget_tokens": 9,
                                                                  "display": "full"}, "thinking.display"),
    ("yes", "thinking")])
def test_bad_thinking_is_a_400_in_anthropics_shape_naming_the_field(server, thinking, param):
    reply = server.post("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": ASK, "thinking": thinking})
    assert reply.status == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"'{param}'" in error["error"]["message"]


THINKING_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.text(max_size=8) | st.sampled_from(
        ["enabled", "adaptive", "disabled", "between_tools", "summarized", "omitted"]),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(
        st.sampled_from(["type", "budget_tokens", "display", "effort", "x"]), inner, max_size=3), max_leaves=5)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(THINKING_VALUES)
def test_fuzzed_thinking_is_answered_or_refused_with_a_4xx_naming_it(server, thinking):
    reply = server.post("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": ASK, "thinking": thinking})
    if reply.status == 200:
        assert reply.json()["type"] == "message"
        return
    assert reply.status == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert "'thinking" in reply.json()["error"]["message"], reply.text


# ---------------------------------------------------------------------------------------- Responses

def _response(chat, **kwargs):
    return chat.responses.create(model=MODEL, max_output_tokens=30, temperature=0,
                                 **{"input": "Hi", "extra_body": {"guided_grammar": FORCED}, **kwargs})


def test_a_response_holds_a_reasoning_item_before_the_message_and_counts_its_tokens(chat):
    response = _response(chat)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert [part.text for part in reasoning.content] == ["Greet back."] and reasoning.summary == []
    assert response.output_text == "Hello there."
    same = chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, temperature=0,
                                        extra_body={"guided_grammar": FORCED})
    thought = response.usage.output_tokens_details.reasoning_tokens
    assert thought == same.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought < response.usage.output_tokens == same.usage.completion_tokens


def test_a_streamed_response_is_the_whole_one_in_typed_events(chat):
    whole = _response(chat)
    events = list(_response(chat, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == whole.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_stored_reasoning_item_is_replayed_and_a_handed_back_one_accepted(chat):
    first = _response(chat)
    assert chat.responses.retrieve(first.id).output[0].type == "reasoning"
    follow = _response(chat, input="And?", previous_response_id=first.id)
    assert follow.status == "completed" and follow.output[0].type == "reasoning"
    items = [{"role": "user", "content": "Hi"}, first.output[0].model_dump(exclude_none=True),
             {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And?"}]
    handed = _response(chat, input=items, store=False)
    assert handed.usage.input_tokens == follow.usage.input_tokens  # the same prompt: thinking is not replayed


@pytest.mark.parametrize("reasoning, param", [({"effort": "high"}, "reasoning.effort"),
                                              ({"summary": "auto"}, "reasoning.summary")])
def test_reasoning_settings_it_cannot_honour_are_400s(chat, reasoning, param):
    with pytest.raises(openai.BadRequestError) as err:
        _response(chat, reasoning=reasoning)
    assert err.value.body["param"] == param
