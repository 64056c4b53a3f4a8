"""Structured outputs in the engine on the tiny random model, which never writes JSON by itself: every output
under a constraint must parse and follow it, unconstrained rows of the same batch must be untouched, and the
grammar state must survive preemption, chunked prefill, n > 1 and speculative decoding."""
from __future__ import annotations

import json
import re

import msgpack
import pytest
import torch

from actors.convert import params_from_wire, params_to_wire
from engine import LLM, SamplingParams
from engine.core.engine_core import EngineRequest, RequestError
from engine.sampling.json_grammar import MAX_INDENT
from engine.sampling.structured import Guide, GuideError, mask_logits, token_bytes
from transport import codec
from transport import messages as m

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
JSON_GUIDE = Guide.json_schema(SCHEMA)
# The most tokens a document of SCHEMA's grammar takes: 12 gaps of a newline and MAX_INDENT blanks, a name of 6
# characters of up to 4 bytes each, and the rest of the syntax. Every constrained output closes within it.
LONGEST = 12 * (1 + MAX_INDENT) + 6 * 4 + 2 + len('{"name":"age":"ok":,,}') + len("120") + len("false")
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ("red", "green", "blue")
SMALL_POOL = dict(num_kv_blocks=24, max_num_batched_tokens=64, enable_chunked_prefill=True)
PROMPTS = [[5 + i, 40 + 3 * i, 77, 100 + i, 9] * (1 + i % 3) for i in range(6)]


def tiny_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, **options})


def check_schema(text: str) -> None:
    """`text` is one JSON object that follows SCHEMA (checked by hand: no jsonschema dependency)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, text
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, text
    assert isinstance(value["ok"], bool), text


def guided(guide: Guide, **fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": LONGEST, "temperature": 0.0, "guide": guide, **fields})


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


def test_json_schema_outputs_parse_and_validate(llm):
    greedy = llm.generate(PROMPTS, guided(JSON_GUIDE))
    sampled = llm.generate(PROMPTS[:2], guided(JSON_GUIDE, temperature=1.0, seed=3, n=3))
    for out in [o for r in greedy + sampled for o in r.outputs]:
        assert out.finish_reason == "stop"
        check_schema(out.text)


def test_json_object_outputs_an_object(llm):
    for r in llm.generate(PROMPTS[:3], guided(Guide("json_object"), max_tokens=200, temperature=0.7, seed=1)):
        if r.outputs[0].finish_reason == "stop":  # an open-ended object may run out of tokens
            assert isinstance(json.loads(r.outputs[0].text), dict)
        else:
            assert r.outputs[0].text.lstrip().startswith("{")


def test_regex_and_choice_hold_on_seeded_samples(llm):
    regex = llm.generate([PROMPTS[0]], guided(Guide("regex", REGEX), temperature=1.0, seed=11, n=20))
    assert all(re.fullmatch(REGEX, o.text) for o in regex[0].outputs), [o.text for o in regex[0].outputs]
    choice = llm.generate([PROMPTS[1]], guided(Guide("choice", choices=CHOICES), temperature=1.0, seed=5, n=20))
    assert all(o.text in CHOICES for o in choice[0].outputs), [o.text for o in choice[0].outputs]


def test_free_rows_of_a_mixed_batch_equal_their_plain_greedy_output(llm, tiny_model_dir):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [r.outputs[0].token_ids for r in tiny_llm(tiny_model_dir).generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS, [plain if i % 2 else guided(JSON_GUIDE) for i in range(len(PROMPTS))])
    for i, r in enumerate(mixed):
        if i % 2:
            assert r.outputs[0].token_ids == alone[i]
        else:
            check_schema(r.outputs[0].text)


def test_greedy_under_a_grammar_equals_plain_greedy_when_that_already_fits(llm):
    """A choice of exactly the unconstrained output allows every token the model picks by itself. Outputs
    whose text is not their bytes (a special token, a split UTF-8 character) cannot be spelled as a choice."""
    vocab_bytes, _ = token_bytes(llm.tokenizer)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    checked = 0
    for r in llm.generate([[t + 1 for t in p] for p in PROMPTS] + PROMPTS, plain):
        text = r.outputs[0].text
        if b"".join(vocab_bytes[t] for t in r.outputs[0].token_ids) != text.encode():
            continue
        checked += 1
        constrained = llm.generate([r.prompt_token_ids], guided(Guide("choice", choices=(text,)), max_tokens=12))
        assert constrained[0].outputs[0].token_ids == r.outputs[0].token_ids
    assert checked >= 2


def test_preemption_and_chunked_prefill_keep_outputs_valid_and_unchanged(llm, tiny_model_dir):
    prompts = [p * 3 for p in PROMPTS]
    roomy = [r.outputs[0].token_ids for r in llm.generate(prompts, guided(JSON_GUIDE))]
    small = tiny_llm(tiny_model_dir, **SMALL_POOL)
    outs = small.generate(prompts, guided(JSON_GUIDE))
    assert small.engine.stats().num_preemptions > 0
    for r, expected in zip(outs, roomy):
        check_schema(r.outputs[0].text)
        assert r.outputs[0].token_ids == expected


@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_model="self:1")],
                         ids=["ngram", "draft"])
def test_speculative_decoding_under_a_grammar_equals_plain_decoding(llm, tiny_model_dir, options):
    params = [guided(JSON_GUIDE), guided(Guide("regex", REGEX)), SamplingParams(max_tokens=30, temperature=0.0)]
    plain = [r.outputs[0].token_ids for r in llm.generate(PROMPTS[:3], params)]
    spec = tiny_llm(tiny_model_dir, num_speculative_tokens=4, **options)
    outs = spec.generate(PROMPTS[:3], params)
    assert [r.outputs[0].token_ids for r in outs] == plain
    check_schema(outs[0].outputs[0].text)
    assert re.fullmatch(REGEX, outs[1].outputs[0].text)


def test_sampled_speculation_under_a_grammar_stays_valid(tiny_model_dir):
    spec = tiny_llm(tiny_model_dir, num_speculative_tokens=3, speculative="draft", draft_model="self:1")
    outs = spec.generate([PROMPTS[0]], guided(JSON_GUIDE, temperature=1.0, seed=2, n=4))
    for o in outs[0].outputs:
        check_schema(o.text)


def test_a_constraint_that_cannot_compile_is_refused(llm):
    bad = EngineRequest("bad", [5, 6, 7], guided(Guide.json_schema({"type": "nonsense"})))
    with pytest.raises(RequestError, match="nonsense"):
        llm.engine.add_request(bad)
    with pytest.raises(GuideError):
        Guide.json_schema("{not json")


def test_the_http_front_end_builds_a_constraint_without_compiling_it(llm, monkeypatch):
    """The server's preparation leaves compiling to the engine (in this process or an actor's)."""
    import asyncio

    from engine.sampling.structured import GrammarCompiler
    from frontend.front_door import FrontDoor
    from server.generation import prepare
    from server.protocol import ModelLimits, parse_chat
    from server.quadrant import QuadrantThresholds

    def refuse(*args, **kwargs):
        raise AssertionError("the front end compiled a constraint")

    monkeypatch.setattr(GrammarCompiler, "compile", refuse)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "response_format": fmt,
                      "max_tokens": 4}, "m")
    door = FrontDoor.for_source(llm.engine.source)
    prepared = asyncio.run(prepare(req, door, ModelLimits("m", 1024, 512), QuadrantThresholds()))
    assert prepared.params.guide == Guide.json_schema({"type": "nonsense"})
    assert prepared.guide_param == "response_format"


def test_the_constraint_travels_in_the_wire_params():
    for guide in (JSON_GUIDE, Guide("choice", choices=CHOICES), Guide("regex", REGEX), None):
        params = guided(guide, n=2)
        raw = msgpack.unpackb(msgpack.packb(params_to_wire(params)))
        assert params_from_wire(raw) == params
        decoded = codec.decode(codec.encode(m.AddRequest("r", [1, 2], params_to_wire(params))))
        assert params_from_wire(decoded.sampling) == params


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_logits_forbids_exactly_the_cleared_bits_of_the_named_rows(dtype):
    gen = torch.Generator().manual_seed(3)
    vocab, batch = 100, 5  # a vocabulary that is not a whole number of 32-bit words
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    rows = torch.tensor([1, 3])
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, -(-vocab // 32)), dtype=torch.int32, generator=gen)
    out = mask_logits(logits, rows, bitmask)
    allowed = torch.ones(batch, vocab, dtype=torch.bool)
    for g, row in enumerate(rows.tolist()):
        for token in range(vocab):
            allowed[row, token] = bool((int(bitmask[g, token // 32]) >> (token % 32)) & 1)
    assert torch.equal(out.isinf(), ~allowed) and (~allowed).any()
    assert torch.equal(out[allowed], logits[allowed]) and not logits.isinf().any()  # the input is left as it was
