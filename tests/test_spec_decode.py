"""Speculative decoding in the engine: greedy outputs unchanged by every proposer, in mixed batches under chunked
prefill and preemption; acceptance 1.0 with a draft identical to the target; seeded sampling reproducible."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.engine_core import EngineRequest
from engine.core.treatment import Treatment
from engine.model.loader import load_model, resolve_model
from engine.speculative.draft_model import DraftModelProposer, LayerPrefixModel
from engine.speculative.proposer import DraftRequest

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
SMALL_POOL = dict(num_kv_blocks=24, max_num_batched_tokens=64, enable_chunked_prefill=True)
_ids = itertools.count()


pytestmark = pytest.mark.usefixtures("one_thread")


def repetitive_prompts(count: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """A random phrase said three times, then a few random tokens: prompt lookup finds continuations."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 10))]
        prompts.append(phrase * 3 + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 4))])
    return prompts


def tiny_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, **options})


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams,
        speculate: list[bool | None] | None = None) -> list[list[int]]:
    """Drive the engine directly (per-request `speculate`); one token list per prompt."""
    speculate = speculate or [None] * len(prompts)
    ids = [f"s{next(_ids)}" for _ in prompts]
    for rid, prompt, flag in zip(ids, prompts, speculate):
        llm.engine.add_request(EngineRequest(rid, prompt, params, treatment=Treatment(speculate=flag)))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while llm.engine.has_unfinished_requests():
        for upd in llm.engine.step():
            if upd.token_id is not None:
                tokens[upd.request_id].append(upd.token_id)
        check_kv_invariants(llm)
    return [tokens[rid] for rid in ids]


def check_kv_invariants(llm: LLM) -> None:
    """After every step: only blocks of final tokens are registered, no block lies past a sequence's tokens."""
    bs = llm.engine.pool.block_size
    for seq in llm.engine.scheduler.running:
        assert seq.num_computed_tokens < seq.num_tokens
        assert len(seq.block_hashes) <= seq.num_computed_tokens // bs
        assert len(seq.block_ids) <= -(-seq.num_tokens // bs)


def assert_clean(llm: LLM) -> None:
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used == 0
    proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
    if isinstance(proposer, DraftModelProposer):
        proposer.pool.check_integrity()
        assert proposer.pool.num_used == 0 and not proposer.seqs


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(16)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    return run(tiny_llm(tiny_model_dir), prompts, GREEDY)


class RecordingProposer:
    """Wraps a proposer and records which sequences it was asked about."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.asked: set[int] = set()

    def propose(self, requests):
        self.asked.update(r.seq_id for r in requests)
        return self.inner.propose(requests)

    def on_accepted(self, seq_id, num_tokens_kept):
        self.inner.on_accepted(seq_id, num_tokens_kept)

    def release(self, seq_id):
        self.inner.release(seq_id)


@pytest.mark.parametrize("mode", ["ngram", "self:1", "draft"])
def test_greedy_outputs_unchanged_in_a_mixed_batch_with_preemption(tiny_model_dir, draft_dir, prompts, reference,
                                                                   mode):
    options = dict(speculative="ngram") if mode == "ngram" else \
        dict(speculative="draft", draft_model=mode if mode.startswith("self:") else str(draft_dir))
    llm = tiny_llm(tiny_model_dir, num_speculative_tokens=4, **options, **SMALL_POOL)
    recorder = llm.engine.speculator.proposer = RecordingProposer(llm.engine.speculator.proposer)
    speculate = [False if i % 4 == 0 else None for i in range(len(prompts))]  # every 4th opts out
    assert run(llm, prompts, GREEDY, speculate) == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_proposed > 0 and stats.spec_steps > 0
    if mode == "ngram":
        assert stats.spec_accepted > 0
    assert recorder.asked and all(seq_id % 4 != 0 for seq_id in recorder.asked)  # seq ids follow request order
    llm.engine.speculator.proposer = recorder.inner
    assert_clean(llm)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_draft_identical_to_the_target_is_always_accepted(tiny_model_dir, prompts, params):
    llm = tiny_llm(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir), num_speculative_tokens=3)
    run(llm, prompts[:6], params)
    stats = llm.engine.stats()
    assert stats.spec_proposed > 0
    assert stats.spec_accepted == stats.spec_proposed  # acceptance rate 1.0
    assert_clean(llm)


@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_model="self:1")],
                         ids=["ngram", "self:1"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny_model_dir, prompts, options):
    llm = tiny_llm(tiny_model_dir, **options)
    first = run(llm, prompts[:4], SAMPLED)
    again = run(llm, prompts[:4], SAMPLED)
    fresh = run(tiny_llm(tiny_model_dir, **options), prompts[:4], SAMPLED)
    other_seed = run(llm, prompts[:4], SAMPLED.with_seed(4321))
    assert first == again == fresh
    assert other_seed != first
    assert llm.engine.stats().spec_proposed > 0
    assert_clean(llm)


def test_prefix_cache_after_speculation_holds_only_final_tokens(tiny_model_dir, draft_dir, prompts):
    """A poor draft leaves rejected KV in many blocks; continuing each sequence from the prefix cache must give
    what a cold engine computes, so no block was registered before its tokens were final."""
    llm = tiny_llm(tiny_model_dir, speculative="draft", draft_model=str(draft_dir), block_size=4)
    first = run(llm, prompts[:8], GREEDY)
    assert llm.engine.stats().spec_proposed > llm.engine.stats().spec_accepted  # rejections happened
    continued = [p + out for p, out in zip(prompts[:8], first)]
    hits = llm.engine.pool.prefix.stats.prefix_hits
    warm = run(llm, continued, GREEDY, [False] * 8)
    assert llm.engine.pool.prefix.stats.prefix_hits - hits >= 8 * (len(min(continued, key=len)) // 4 - 1)
    assert warm == run(tiny_llm(tiny_model_dir, enable_prefix_caching=False), continued, GREEDY)
    assert_clean(llm)


def test_stop_tokens_and_lengths_cut_inside_an_accepted_run(tiny_model_dir, prompts, reference):
    llm = tiny_llm(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir))
    i = next(i for i, out in enumerate(reference) if len(set(out[:10])) > 3)
    stop_id = reference[i][7]
    params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop_id])
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert run(llm, [prompts[i]], params)[0] == reference[i][: reference[i].index(stop_id) + 1]
    assert run(llm, [prompts[i]], short)[0] == reference[i][:6]
    assert llm.engine.stats().spec_accepted > 0
    assert_clean(llm)


def test_logprobs_and_min_tokens_match_plain_decoding(tiny_model_dir, prompts):
    params = SamplingParams(max_tokens=16, min_tokens=10, temperature=0.0, logprobs=2,
                            stop_token_ids=[reference_token(tiny_model_dir, prompts[1])])
    plain = tiny_llm(tiny_model_dir).generate([prompts[1]], params)[0].outputs[0]
    spec = tiny_llm(tiny_model_dir, speculative="draft", draft_model=str(tiny_model_dir)).generate(
        [prompts[1]], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) >= 10
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def reference_token(model_dir, prompt: list[int]) -> int:
    """The third greedy token: as a stop id under min_tokens it must be banned at every verified position."""
    return tiny_llm(model_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids[2]


class FailingProposer:
    def propose(self, requests):
        raise RuntimeError("draft died")

    def on_accepted(self, seq_id, num_tokens_kept):
        pass

    def release(self, seq_id):
        pass


def test_a_failing_proposer_only_turns_speculation_off(tiny_model_dir, prompts, reference):
    llm = tiny_llm(tiny_model_dir, speculative="ngram")
    llm.engine.speculator.proposer = FailingProposer()
    assert run(llm, prompts[:4], GREEDY) == reference[:4]
    assert llm.engine.speculator.num_failures > 0
    assert llm.engine.stats().spec_proposed == 0
    assert_clean(llm)


def test_draft_kv_rolls_back_to_what_the_target_kept(tiny_model_dir, prompts):
    """After random acceptances (rejections replaced by other tokens, missed reports, steps without drafting) the
    stateful draft's first distribution equals that of a fresh draft reading the whole sequence; release frees
    everything."""
    model = load_model(resolve_model(str(tiny_model_dir)), torch.float32)
    draft = DraftModelProposer(LayerPrefixModel(model, 2), num_blocks=64, block_size=4, dtype=torch.float32)
    rng = random.Random(3)
    tokens = list(prompts[0])
    for step in range(12):
        request = DraftRequest(0, tokens, 4, SAMPLED)
        proposed = draft.propose([request])[0]
        fresh = DraftModelProposer(LayerPrefixModel(model, 2), 64, 4, torch.float32).propose([request])[0]
        assert len(proposed.token_ids) == 4
        torch.testing.assert_close(proposed.draft_probs[0], fresh.draft_probs[0], atol=1e-5, rtol=1e-4)
        kept = rng.randrange(0, 5)
        if step % 3:  # sometimes the engine's report is missing: the draft must notice by itself
            draft.on_accepted(0, len(tokens) + kept)
        tokens = tokens + proposed.token_ids[:kept] + [rng.randrange(3, 512)]
        if step % 4 == 1:  # steps without speculation: the sequence moves on while the draft sleeps
            tokens += [rng.randrange(3, 512) for _ in range(3)]
    draft.release(0)
    draft.pool.check_integrity()
    assert draft.pool.num_used == 0 and not draft.seqs
