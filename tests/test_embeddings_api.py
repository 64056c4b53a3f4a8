"""/v1/embeddings and the prompt's log-probabilities through the real server on the default model (SmolLM2), with
the official openai client: shapes, unit norms, identical inputs, a batch against its inputs one by one, base64
against float; prompt_logprobs against the model's own fp32 logits across chunk boundaries and after a
prefix-cache hit, and echo with logprobs. Bad bodies on the new route get 4xx naming their field (a table, and
a seeded fuzz of the parser). A tiny server with a prefill actor shows such requests are never handed off."""
from __future__ import annotations

import base64
import json
import random
import struct

import pytest
import torch

from server.embeddings import parse_embedding_request
from server.errors import ApiError
from tests.server_utils import TINY_ENGINE_FLAGS, openai_client, start_server

MODEL = "smollm2"
HIDDEN = 576  # SmolLM2-135M's hidden size
STEP_TOKENS = 32  # the server's token budget per step: a longer prompt's prefill crosses chunk boundaries
BLOCK = 16  # the default block size: an input shorter than one block never hits the prefix cache
LONG_TEXT = ("The river wound through the valley, past the mill and the old stone bridge, where the children of the "
             "village gathered every summer evening to watch the swallows skim the water and the light fade over "
             "the hills beyond the orchards. Their grandparents had done the same, and told of the winter the "
             "river froze so hard that a cart crossed it, and of the spring flood that carried the mill wheel "
             "halfway to the sea.")
SHORT = ["Hello world", "Paris is the capital of France.", "def f(x): return x"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """In float32: its logits then depend on how a prompt is split into chunks only by fp32 rounding (bf16
    activations move a logprob by up to ~0.1 between a whole prompt and the same prompt in chunks)."""
    proc = start_server(tmp_path_factory.mktemp("embeddings-api") / "server.log", "--served-model-name", MODEL,
                        "--num-kv-blocks", "256", "--threads", "2", "--max-num-batched-tokens", str(STEP_TOKENS),
                        "--dtype", "float32")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _vectors(response) -> list[list[float]]:
    return [d.embedding for d in sorted(response.data, key=lambda d: d.index)]


# ---------------------------------------------------------------------------------------- embeddings

@pytest.mark.slow
def test_embeddings_have_the_models_width_unit_norms_and_usage(client, server):
    out = client.embeddings.create(model=MODEL, input=SHORT + [LONG_TEXT], encoding_format="float")
    assert out.object == "list" and out.model == MODEL and [d.index for d in out.data] == [0, 1, 2, 3]
    assert all(d.object == "embedding" and len(d.embedding) == HIDDEN for d in out.data)
    assert all(abs(sum(x * x for x in d.embedding) - 1.0) < 1e-4 for d in out.data)
    tokens = server.post("/tokenize", {"prompt": LONG_TEXT}).json()["count"]
    assert tokens > STEP_TOKENS  # the long input's prefill ran in chunks
    assert out.usage.prompt_tokens == out.usage.total_tokens > tokens
    vectors = torch.tensor(_vectors(out))
    assert (vectors @ vectors.T - torch.eye(4)).abs().max() > 1e-3  # different inputs, different vectors


@pytest.mark.slow
def test_identical_inputs_give_identical_vectors(client):
    together = _vectors(client.embeddings.create(model=MODEL, input=[SHORT[1], SHORT[1]], encoding_format="float"))
    assert together[0] == together[1]
    alone = [_vectors(client.embeddings.create(model=MODEL, input=SHORT[1], encoding_format="float"))[0]
             for _ in range(2)]
    assert alone[0] == alone[1]  # shorter than a block: computed afresh, the same way each time
    # beside another input, the products have other shapes: equal to fp32 rounding
    assert (torch.tensor(alone[0]) - torch.tensor(together[0])).abs().max().item() < 1e-5


@pytest.mark.slow
def test_a_batch_equals_its_inputs_one_by_one(client):
    inputs = SHORT + [LONG_TEXT, [1, 2, 3, 4, 5, 6, 7]]
    batch = torch.tensor(_vectors(client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")))
    alone = torch.tensor([_vectors(client.embeddings.create(model=MODEL, input=item, encoding_format="float"))[0]
                          for item in inputs])
    # computed in other batches (and the long input from its cached prefix): equal to fp32 rounding
    print(f"\nbatch against one by one: largest difference {(batch - alone).abs().max().item():.2e}")
    assert (batch - alone).abs().max().item() < 5e-4
    assert torch.nn.functional.cosine_similarity(batch, alone).min().item() > 1 - 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("text", SHORT)
def test_base64_decodes_to_the_float_vectors(client, server, text):
    # One input per request, shorter than a block: each runs alone and afresh, so the vectors are the same bits.
    floats = _vectors(client.embeddings.create(model=MODEL, input=text, encoding_format="float"))[0]
    raw = server.post("/v1/embeddings", {"model": MODEL, "input": text, "encoding_format": "base64"}).json()
    encoded = raw["data"][0]["embedding"]
    assert isinstance(encoded, str) and list(struct.unpack(f"<{HIDDEN}f", base64.b64decode(encoded))) == floats
    assert _vectors(client.embeddings.create(model=MODEL, input=text))[0] == floats  # the client's default: base64


@pytest.mark.slow
@pytest.mark.parametrize("body,param,status", [
    ({}, "input", 400),
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": [[]]}, "input", 400),
    ({"input": ["ok", 5]}, "input", 400),
    ({"input": [1, "a"]}, "input", 400),
    ({"input": {"text": "x"}}, "input", 400),
    ({"input": [49152]}, "input", 400),
    ({"input": [[1, -1]]}, "input", 400),
    ({"input": [1] * 8192}, "input", 400),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": "x", "encoding_format": 1}, "encoding_format", 400),
    ({"input": "x", "dimensions": 256}, "dimensions", 400),
    ({"input": "x", "dimensions": "576"}, "dimensions", 400),
    ({"input": "x", "user": 7}, "user", 400),
    ({"input": "x", "model": "gpt-4"}, "model", 404),
    ({"input": "x", "model": 3}, "model", 400),
    ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens", 400),
    ({"input": "x", "normalize": False}, "normalize", 400),
    ({"input": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
])
def test_bad_embedding_bodies_are_4xx_naming_the_field(server, body, param, status):
    result = server.post("/v1/embeddings", {"model": MODEL, **body})
    error = result.json()["error"]
    assert result.status == status and error["param"] == param, error


@pytest.mark.slow
def test_what_the_route_accepts_beside_the_input(server, client):
    import openai

    out = client.embeddings.create(model=MODEL, input="x", dimensions=HIDDEN, user="someone", encoding_format="float")
    assert len(out.data[0].embedding) == HIDDEN
    raw = server.post("/v1/embeddings", b"{not json")
    assert raw.status == 400 and raw.json()["error"]["code"] == "invalid_json"
    too_long = server.post("/tokenize", {"prompt": LONG_TEXT * 120}).json()["count"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["fine", LONG_TEXT * 120])
    assert too_long >= 8192 and err.value.body["param"] == "input"
    assert err.value.body["code"] == "context_length_exceeded" and "input[1]" in err.value.body["message"]


FUZZ_VALUES = [None, True, 0, -1, 2.5, "", "x", "base64", "float", [], [0], [[]], [[1, 2]], ["a", [1]], {}, {"a": 1},
               [None], [True], 576, 1 << 70, ["x"] * 3, [1.5], "\u0000", MODEL]
FUZZ_FIELDS = ["input", "encoding_format", "dimensions", "user", "model", "add_special_tokens", "normalize",
               "truncate_prompt_tokens", "messages", "embed_dtype", "extra"]


def fuzz_bodies(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        body = {name: rng.choice(FUZZ_VALUES) for name in rng.sample(FUZZ_FIELDS, rng.randint(1, 5))}
        if rng.random() < 0.5:
            body.setdefault("input", "x")
        bodies.append(body)
    return bodies


@pytest.mark.slow
def test_fuzzed_bodies_through_the_server_never_get_a_5xx(server):
    statuses = set()
    for body in fuzz_bodies(380, 60):
        result = server.post("/v1/embeddings", body)
        statuses.add(result.status)
        assert result.status < 500, (body, result.body)
        if result.status >= 400:
            assert result.json()["error"]["param"] in (*body, "input"), (body, result.body)
    assert 200 in statuses and 400 in statuses


@pytest.mark.unit
def test_a_seeded_fuzz_of_embedding_bodies_gets_only_4xx_naming_a_field_it_holds():
    accepted = 0
    for body in fuzz_bodies(38, 2000):
        try:
            parse_embedding_request(json.loads(json.dumps(body)), MODEL, HIDDEN)
            accepted += 1
        except ApiError as err:
            assert 400 <= err.status < 500 and (err.param in body or err.param == "input"), (body, err.message)
            assert err.param in err.message or err.param == "input", (body, err.message)
    assert accepted > 0


# ---------------------------------------------------------------------------------------- prompt logprobs

@pytest.fixture(scope="module")
def own_logprobs():
    """The default model as the server loads it, in this process: one forward over a whole prompt, the LM head
    over every row, log-softmax in fp32 (the reference, computed without the prompt pass)."""
    from engine import LLM, SamplingParams
    from engine.core.runner import prepare_input
    from engine.core.step import build_chunk

    llm = LLM(num_kv_blocks=64, num_threads=2, dtype="float32")
    engine = llm.engine
    model, bs = engine.runner.model, engine.kv_cache.block_size

    @torch.inference_mode()
    def run(ids: list[int]) -> torch.Tensor:
        chunk = build_chunk(0, ids, 0, len(ids), range(-(-len(ids) // bs)), SamplingParams(), 0, len(ids),
                            frozenset())
        inp = prepare_input([chunk], bs, "cpu", engine.runner.backend.attends_in_place)
        hidden = model(inp.input_ids, inp.positions, inp.meta, engine.kv_cache.layers)
        return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)

    return run


def _assert_matches(rows: list, ids: list[int], logp: torch.Tensor, top: int) -> None:
    assert rows[0] is None and len(rows) == len(ids)
    worst = 0.0
    for i in range(1, len(ids)):
        row, ref = rows[i], logp[i - 1]
        mine = row[str(ids[i])]
        worst = max(worst, abs(mine["logprob"] - ref[ids[i]].item()))
        assert mine["logprob"] == pytest.approx(ref[ids[i]].item(), abs=1e-3), i
        assert mine["rank"] == int((ref > ref[ids[i]]).sum()) + 1 or abs(ref.sort(descending=True).values[
            mine["rank"] - 1] - ref[ids[i]]) < 1e-3  # a near tie may order either way
        assert len(row) in (top, top + 1) and all(e["logprob"] <= 0 for e in row.values())
        values, indices = ref.topk(top)
        floor = min(e["logprob"] for e in row.values())
        for token, value in zip(indices.tolist(), values.tolist()):  # the likeliest, but where a near tie swaps
            assert str(token) in row and row[str(token)]["logprob"] == pytest.approx(value, abs=1e-3) \
                or value - floor < 1e-3
    print(f"\nprompt logprobs against the model's own: largest difference {worst:.2e}")


@pytest.mark.slow
def test_prompt_logprobs_across_chunks_and_after_a_cache_hit_equal_the_models_own(client, server, own_logprobs):
    ids = server.post("/tokenize", {"prompt": LONG_TEXT}).json()["tokens"]
    assert len(ids) > 2 * STEP_TOKENS  # three chunks at least
    reference = own_logprobs(ids)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prompt is in the prefix cache now
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    _assert_matches(scored.choices[0].model_extra["prompt_logprobs"], ids, reference, 2)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, not read from the cache
    assert scored.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_TEXT}],
                                          max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    listed = chat.model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == chat.usage.prompt_tokens
    assert all(len(row) == 1 and next(iter(row.values()))["rank"] >= 1 for row in listed[1:])


@pytest.mark.slow
def test_echo_with_logprobs_prepends_the_prompts_tokens(client, server, own_logprobs):
    ids = server.post("/tokenize", {"prompt": LONG_TEXT}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=LONG_TEXT, max_tokens=4, temperature=0, echo=True,
                                    logprobs=1)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(LONG_TEXT)
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = own_logprobs(ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(reference[i - 1, ids[i]].item(), abs=1e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


# ---------------------------------------------------------------------------------------- never handed off

@pytest.fixture(scope="module")
def disaggregating(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("embeddings-disagg") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", "tiny", "--prefill-actors", "1",
                        "--disagg", "always")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.process
def test_prompt_outputs_are_prefilled_where_they_run_even_when_every_prompt_is_handed_off(disaggregating):
    ids = list(range(10, 60))
    plain = disaggregating.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2})
    assert plain.status == 200 and plain.headers["X-Placement"].startswith("disaggregated")
    scored = disaggregating.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                     "prompt_logprobs": 1})
    assert scored.status == 200 and scored.headers["X-Placement"].startswith("colocated")
    rows = scored.json()["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    embedded = disaggregating.post("/v1/embeddings", {"model": "tiny", "input": [ids, "Hello"]})
    assert embedded.status == 200 and [len(d["embedding"]) for d in embedded.json()["data"]] == [64, 64]
