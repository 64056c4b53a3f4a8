"""The utility routes and shapes through the real server (a decode actor), driven by the official openai
client: one model's card, /tokenize and /detokenize, prompt lists on /v1/completions, cached_tokens from the
prefix cache, 404 for an unknown model, and /v1/embeddings on the tiny model."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HfTokenizer

from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server

MODEL = "tiny-routes"
CONTEXT_LEN = 1024  # the tiny model's max_position_embeddings
BLOCK = 8  # TINY_ENGINE_FLAGS' --block-size
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("routes") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


# ---------------------------------------------------------------------------------------- models

def test_a_model_card_is_openais_model_object(client, server):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "phase-serve")
    listed = client.models.list().data[0]
    assert card.created == listed.created and card.model_extra["max_model_len"] == CONTEXT_LEN


def test_another_model_id_is_404_model_not_found(client):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model" and MODEL in body["message"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_an_unknown_model_is_404_model_not_found_on_generation(client, route):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        if route == "completions":
            client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
        else:
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------------------------------- tokenize

def _post(client, path, body, **kwargs):
    """A JSON POST outside /v1 through the openai client (its base URL ends in /v1)."""
    return client.post(f"{client.base_url.scheme}://{client.base_url.host}:{client.base_url.port}{path}",
                       body=body, cast_to=object, **kwargs)


TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "  two  spaces\nand a line, café ☕"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_gives_the_text_back(client, tokenizer, text):
    out = _post(client, "/tokenize", {"model": MODEL, "prompt": text})
    assert out["tokens"] == tokenizer.encode(text).ids
    assert (out["count"], out["max_model_len"]) == (len(out["tokens"]), CONTEXT_LEN)
    assert _post(client, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}) == {"prompt": text}


def test_tokenize_counts_what_a_completion_bills(client):
    text = "Count these prompt tokens"
    counted = _post(client, "/tokenize", {"prompt": text})["count"]
    assert client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens == counted


def test_tokenize_messages_counts_what_a_chat_bills(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with_prompt = _post(client, "/tokenize", {"model": MODEL, "messages": messages})
    without = _post(client, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert without["count"] < with_prompt["count"]
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == with_prompt["count"]


def test_tokenize_returns_token_strings_on_request(client, tokenizer):
    out = _post(client, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert out["token_strs"] == [tokenizer.id_to_token(t) for t in out["tokens"]]
    assert _post(client, "/tokenize", {"prompt": "Hello world"})["token_strs"] is None


BAD_TOKENIZE = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": 3}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "hello"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_TOKENIZE, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_TOKENIZE)])
def test_bad_tokenize_input_is_400_naming_the_param(server, path, body, param):
    result = server.post(path, body)
    assert result.status == 400, result.body
    error = result.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize("path,body", [("/tokenize", {"model": "gpt-4", "prompt": "x"}),
                                       ("/detokenize", {"model": "gpt-4", "tokens": [1]})])
def test_tokenize_with_another_model_is_404(server, path, body):
    result = server.post(path, body)
    assert result.status == 404 and result.json()["error"]["code"] == "model_not_found"


def test_the_404_sentence_lists_the_new_routes(server):
    message = server.get("/v1/nothing").json()["error"]["message"]
    assert all(route in message for route in ("GET /v1/models/{id}", "POST /tokenize", "POST /detokenize",
                                              "POST /v1/embeddings"))


# ---------------------------------------------------------------------------------------- prompt lists

PROMPTS = ["Once upon a time", "The capital of France", "1, 2, 3,"]


def _alone(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def test_a_prompt_list_answers_each_prompt_in_index_order(client):
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    alone = [_alone(client, p, max_tokens=6, **GREEDY) for p in PROMPTS]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert (batch.usage.completion_tokens, batch.usage.total_tokens) == (18, 18 + batch.usage.prompt_tokens)


def test_a_list_of_token_id_prompts_matches_text_prompts(client, tokenizer):
    ids = [tokenizer.encode(p).ids for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, **GREEDY)
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=5, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]


def test_prompt_list_with_n_orders_prompt_major(client):
    """Prompt i, sample j -> index i * n + j; each prompt's samples are its own (same seed, same samples)."""
    kwargs = dict(max_tokens=8, temperature=1.0, seed=11, n=2, extra_body={"ignore_eos": True})
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, **kwargs)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        alone = _alone(client, prompt, **kwargs)
        assert [c.text for c in batch.choices[2 * i:2 * i + 2]] == [c.text for c in alone.choices]
    assert batch.usage.completion_tokens == 6 * 8


def test_a_streamed_prompt_list_carries_every_index_and_sums_usage(client):
    kwargs = dict(max_tokens=6, n=2, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, **kwargs)
    texts, finished = {}, {}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finished
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == list(range(6))
    assert texts == {c.index: c.text for c in whole.choices}
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens == 36


def test_echo_in_a_prompt_list_echoes_each_prompt(client):
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3, echo=True, **GREEDY)
    assert all(c.text.startswith(p) and len(c.text) > len(p) for c, p in zip(batch.choices, PROMPTS))


@pytest.mark.parametrize("prompt", [["fine", ""], ["fine", 5], ["fine", [1, 99999]], ["fine", [[1]]]])
def test_one_bad_prompt_refuses_the_whole_list(server, prompt):
    result = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert result.status == 400, result.body
    assert result.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------------------------------- cached tokens

def _long_prompt(tokenizer, salt: str) -> str:
    text = f"{salt}: " + " ".join(f"word{i} and then" for i in range(30))
    assert len(tokenizer.encode(text).ids) > 4 * BLOCK
    return text


def test_a_repeated_long_prompt_reports_cached_tokens(client, tokenizer):
    prompt = _long_prompt(tokenizer, "completion")
    cold = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    warm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0 and cached < warm.usage.prompt_tokens


def test_cached_tokens_on_chat_streamed_and_not(client, tokenizer):
    messages = [{"role": "user", "content": _long_prompt(tokenizer, "chat")}]
    cold = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    warm = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    # The template's opening may be cached from earlier chats; the message itself is new only the first time.
    assert cold.usage.prompt_tokens_details.cached_tokens < warm.usage.prompt_tokens_details.cached_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == warm.usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_sum_over_a_prompt_list(client, tokenizer):
    prompts = [_long_prompt(tokenizer, "list-a"), _long_prompt(tokenizer, "list-b")]
    first = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=2).usage for p in prompts]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = [u.prompt_tokens_details.cached_tokens for u in alone]
    assert min(cached) > 0 and again.usage.prompt_tokens_details.cached_tokens == sum(cached)


# ---------------------------------------------------------------------------------------- embeddings

def test_embeddings_of_the_tiny_model_are_unit_vectors_of_its_width(client):
    out = client.embeddings.create(model=MODEL, input=["Hello", [40, 41, 42]])
    assert [len(d.embedding) for d in out.data] == [64, 64]  # the tiny model's hidden size
    assert all(abs(sum(x * x for x in d.embedding) - 1) < 1e-5 for d in out.data)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3


@pytest.mark.unit
def test_the_four_prompt_shapes_parse_into_one_request_per_prompt():
    from server.protocol import parse_completion

    shapes = {"text": ("one",), "ids": ((1, 2),), "texts": ("one", "two"), "id lists": ((1,), (2, 3)),
              "mixed": ("one", (2, 3))}
    bodies = {"text": "one", "ids": [1, 2], "texts": ["one", "two"], "id lists": [[1], [2, 3]],
              "mixed": ["one", [2, 3]]}
    for name, prompt in bodies.items():
        parts = parse_completion({"prompt": prompt, "n": 2}, MODEL).per_prompt()
        assert tuple(p.prompt for p in parts) == shapes[name], name
        assert all(p.prompts == () and p.sampling.params.n == 2 for p in parts)
