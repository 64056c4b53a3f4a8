"""The sampling controls in the engine on the tiny random model: every greedy token checked against the
plain-Python reference applied to the model's own logits for the whole sequence, under batching, chunked
prefill, preemption, n > 1 and speculative decoding."""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import TorchBackend
from engine.backends.attention import AttentionMetadata
from engine.core.runner import ModelRunner
from engine.kv.cache import KVCache
from engine.model.loader import load_model, resolve_model
from engine.model.progress import COMPILING_SAMPLER
from engine.sampling.sampler import dense_distribution
from tests.sampling_reference import adjusted_logits, distribution

pytestmark = pytest.mark.usefixtures("one_thread")

PENALISED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.6,
                           frequency_penalty=0.9, repetition_penalty=1.4, logit_bias={11: 2.0, 40: -1.5})
SMALL_POOL = dict(num_kv_blocks=24, max_num_batched_tokens=64, enable_chunked_prefill=True)
BLOCK = 8


def tiny_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "num_kv_blocks": 256, "block_size": BLOCK, **options})


def make_prompts(count: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(resolve_model(str(tiny_model_dir)), torch.float32)


def sequence_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float32: the model's next-token logits at every position, from one prefill."""
    num_blocks = -(-len(token_ids) // BLOCK)
    kv = KVCache(model.cfg, num_blocks, BLOCK, torch.float32)
    meta = AttentionMetadata.build(BLOCK, [], [(list(range(num_blocks)), 0, len(token_ids))])
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), meta, kv.layers)
        return model.compute_logits(hidden)


def reference_mismatches(model, prompt: list[int], output: list[int], params: SamplingParams) -> list[int]:
    """Output positions whose token is not the argmax of the reference's penalised logits (a near-tie within
    1e-4 counts as a match: one prefill and paged decoding round differently)."""
    logits = sequence_logits(model, prompt + output)[len(prompt) - 1:]
    bad = []
    for i, token in enumerate(output):
        x = adjusted_logits(logits[i].tolist(), params, prompt, output[:i])
        if x[token] < max(x) - 1e-4:
            bad.append(i)
    return bad


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_a_large_frequency_penalty_stops_the_repeats_of_greedy_decoding(tiny_model_dir, model):
    prompts = make_prompts(6, seed=1)
    llm = tiny_llm(tiny_model_dir)
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    frequency = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    both = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                          presence_penalty=2.0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    assert all(repeats(t) > 5 for t in before)
    # A token whose logit leads the rest by more than 2 may still come back once under frequency alone.
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, frequency)]
    assert all(repeats(t) <= 1 for t in after)
    strict = [o.outputs[0].token_ids for o in llm.generate(prompts, both)]
    assert [repeats(t) for t in strict] == [0] * len(prompts)
    for prompt, out, after_one in zip(prompts, strict, after):
        assert reference_mismatches(model, prompt, out, both) == []
        assert reference_mismatches(model, prompt, after_one, frequency) == []


@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=7, max_num_seqs=5),
    SMALL_POOL,
], ids=["batched", "chunked-7", "preempting"])
def test_greedy_with_every_control_follows_the_reference(tiny_model_dir, model, options):
    prompts = make_prompts(16, seed=2)
    llm = tiny_llm(tiny_model_dir, **options)
    plain = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 16
    params = [PENALISED if i % 2 else plain[i] for i in range(16)]  # mixed batch
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if options is SMALL_POOL:
        assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out, p in zip(prompts, outs, params):
        assert reference_mismatches(model, prompt, out, p) == []
    alone = tiny_llm(tiny_model_dir).generate(prompts[1::2], PENALISED)
    assert outs[1::2] == [o.outputs[0].token_ids for o in alone]
    assert outs[0::2] == [o.outputs[0].token_ids for o in tiny_llm(tiny_model_dir).generate(prompts[0::2], plain[0])]


def test_each_of_n_samples_counts_its_own_tokens(tiny_model_dir, model):
    prompt = make_prompts(1, seed=3)[0]
    llm = tiny_llm(tiny_model_dir)
    single = llm.generate([prompt], PENALISED)[0].outputs[0].token_ids
    many = llm.generate([prompt], SamplingParams(**{**_fields(PENALISED), "n": 3}))[0].outputs
    assert [o.token_ids for o in many] == [single] * 3  # shared counts would push the samples apart
    sampled = SamplingParams(**{**_fields(PENALISED), "n": 4, "temperature": 1.0, "top_k": 3, "seed": 5})
    outs = [o.token_ids for o in llm.generate([prompt], sampled)[0].outputs]
    assert len({tuple(o) for o in outs}) > 1
    for out in outs:  # every draw lies in the top 3 of the penalised logits of its own sample
        logits = sequence_logits(model, prompt + out)[len(prompt) - 1:]
        for i, token in enumerate(out):
            assert distribution(logits[i].tolist(), sampled, prompt, out[:i])[token] > 0


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


@pytest.mark.parametrize("options", [
    dict(speculative="ngram"),
    dict(speculative="draft", draft_model="self:1"),
], ids=["ngram", "self:1"])
def test_speculative_greedy_with_penalties_equals_plain_decoding(tiny_model_dir, model, options):
    prompts = [p * 3 for p in make_prompts(8, seed=4, vocab=60)]  # repetitive: prompt lookup proposes
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=0.3,
                            frequency_penalty=0.2, repetition_penalty=1.1)
    plain = [o.outputs[0].token_ids for o in tiny_llm(tiny_model_dir).generate(prompts, params)]
    llm = tiny_llm(tiny_model_dir, num_speculative_tokens=4, **options, **SMALL_POOL)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0
    assert spec == plain
    for prompt, out in zip(prompts, spec):
        assert reference_mismatches(model, prompt, out, params) == []


@pytest.mark.parametrize("params", [
    PENALISED,
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, min_p=0.05, seed=9, ignore_eos=True,
                   presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={7: 3.0}),
], ids=["greedy", "sampled"])
def test_a_draft_identical_to_the_target_is_always_accepted_under_penalties(tiny_model_dir, params):
    """The draft penalises with the drafts before each position, and so must the target's verification: any
    difference between the two distributions would reject some draft."""
    llm = tiny_llm(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir), num_speculative_tokens=3)
    llm.generate(make_prompts(6, seed=5), params)
    stats = llm.engine.stats()
    assert stats.spec_proposed > 0
    assert stats.spec_accepted == stats.spec_proposed


def test_logit_bias_forces_and_bans_a_token(tiny_model_dir):
    prompts = make_prompts(4, seed=6)
    llm = tiny_llm(tiny_model_dir)
    forced = SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True, logit_bias={123: 100})
    assert all(o.outputs[0].token_ids == [123] * 12 for o in llm.generate(prompts, forced))
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                                                  ignore_eos=True))]
    favourite = max(set(plain[0]), key=plain[0].count)
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={favourite: -100})
    assert all(favourite not in o.outputs[0].token_ids for o in llm.generate(prompts, banned))


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_model_dir):
    from engine.core.engine_core import EngineRequest, RequestError

    llm = tiny_llm(tiny_model_dir)
    with pytest.raises(RequestError) as info:
        llm.engine.add_request(EngineRequest("r", [5, 6], SamplingParams(logit_bias={512: 1.0})))
    assert info.value.param == "logit_bias"


def test_the_lm_head_argmax_shortcut_is_skipped_under_controls(tiny_model_dir, model, monkeypatch):
    """Backends may pick greedy tokens straight off the LM head (no logits): that pick knows no penalties."""
    llm = tiny_llm(tiny_model_dir)
    shortcut = []

    def lm_head_argmax(hidden):
        shortcut.append(hidden.shape[0])
        return torch.zeros(hidden.shape[0], dtype=torch.long)

    monkeypatch.setattr(llm.engine.runner.model, "greedy_tokens", lm_head_argmax)
    prompts = make_prompts(3, seed=7)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, PENALISED)]
    assert not shortcut
    for prompt, out in zip(prompts, outs):
        assert reference_mismatches(model, prompt, out, PENALISED) == []
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert shortcut  # plain greedy still takes it


class FusingBackend(TorchBackend):
    """Plain torch ops that 'fuse' the sampler's distribution by counting its calls (a GPU backend compiles it)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.calls: list[tuple[int, bool]] = []

    def fuse(self, fn):
        def counted(*args):
            self.calls.append((args[0].shape[0], args[-1]))
            return fn(*args)
        return counted


def test_a_runner_samples_through_its_backends_fused_distribution_warmed_at_build(tiny_model_dir):
    """Built on a backend that fuses, the runner warms the distribution in all four variants before any step;
    seeded sampling, plain and speculative (the verifier's distribution), goes through it to the plain tokens."""
    fused_model = load_model(resolve_model(str(tiny_model_dir)), torch.float32)
    backend = FusingBackend()
    heard = []
    runner = ModelRunner(fused_model, None, "cpu", backend=backend, progress=lambda *a: heard.append(a))
    assert sorted(backend.calls) == [(1, False), (1, True), (2, False), (2, True)] and runner.dense is not None
    assert heard == [(COMPILING_SAMPLER, done, 4) for done in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, min_p=0.05, seed=21, ignore_eos=True)
    prompts = make_prompts(3, seed=22)
    for options in ({}, dict(speculative="draft", draft_model="self:1", num_speculative_tokens=2)):
        want = [o.token_ids for o in tiny_llm(tiny_model_dir, **options).generate(prompts, params)]
        llm = tiny_llm(tiny_model_dir, **options)
        llm.engine.runner.dense = backend.fuse(dense_distribution)
        before = len(backend.calls)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        rows = [n for n, _ in backend.calls[before:]]
        assert rows and (not options or max(rows) > len(prompts))  # speculative: a verify step's rows
