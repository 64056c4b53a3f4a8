"""What a request's prompt pass computes besides the KV (engine/core/prompt_pass.py), on the tiny random model:
embeddings equal to the model's own final hidden states pooled (last token, mean) as transformers computes them,
and prompt_logprobs equal to the log-softmax of its fp32 logits at every prompt position, across chunk
boundaries, after a prefix-cache hit, after a preemption, for a batch as for each prompt alone; and both through
the wire format an actor sends them in."""
from __future__ import annotations

import asyncio

import pytest
import torch

from actors.convert import update_from_wire, update_to_wire
from engine import LLM, AsyncLLM, SamplingParams
from engine.core.step import PromptResult, SequenceUpdate
from engine.sampling.sampler import TokenLogprobs
from tests.test_engine import assert_pool_clean, make_prompts, tiny_llm

CHUNKED = dict(max_num_batched_tokens=16)  # a 40-token prompt runs in three chunks (block size 8)
PROMPT = list(range(5, 45))
TOP = 3


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [T, H], after the final norm; log-softmax of the fp32 logits [T, V]) of transformers."""
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0], torch.log_softmax(out.logits[0].float(), dim=-1)


def pooled(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


def assert_prompt_logprobs(entries: list[TokenLogprobs | None], ids: list[int], logp: torch.Tensor,
                           top: int = TOP) -> None:
    """Entry i (i >= 1) scores ids[i] under the logits at position i - 1; entry 0 is None."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        e, row = entries[i], logp[i - 1]
        assert e.token_id == ids[i]
        assert e.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert e.rank == int((row > row[ids[i]]).sum()) + 1
        values, indices = row.topk(top)
        assert [t for t, _ in e.top] == indices.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-4)


# ---------------------------------------------------------------------------------------- embeddings

@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("options", [{}, CHUNKED], ids=["whole", "chunked"])
def test_an_embedding_is_the_pooled_final_hidden_state_normalised(tiny_model_dir, hf, pooling, options):
    llm = tiny_llm(tiny_model_dir, pooling=pooling, **options)
    out = llm.embed(PROMPT)[0]
    hidden, _ = reference(hf, PROMPT)
    vector = torch.tensor(out.embedding)
    assert vector.shape == (64,) and out.prompt_token_ids == PROMPT
    assert vector.norm().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(vector, pooled(hidden, pooling), atol=1e-5, rtol=0)
    assert_pool_clean(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_batch_embeds_as_each_prompt_alone_and_beside_generation(tiny_model_dir, pooling):
    llm = tiny_llm(tiny_model_dir, pooling=pooling, **CHUNKED)
    prompts = make_prompts(4, seed=5)
    alone = [llm.embed(p)[0].embedding for p in prompts]
    together = llm.embed(prompts)
    for one, out in zip(alone, together):
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(one), atol=1e-5, rtol=0)
    generated = llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
    assert all(o.embedding is None and o.prompt_logprobs is None for o in generated)  # generation does not pool


def test_last_token_pooling_may_start_from_a_cached_prefix_and_mean_pooling_does_not(tiny_model_dir, hf):
    hidden, _ = reference(hf, PROMPT)
    for pooling in ("last", "mean"):
        llm = tiny_llm(tiny_model_dir, pooling=pooling)
        llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))  # the prompt's blocks are cached
        out = llm.embed(PROMPT)[0]
        assert (out.num_cached_tokens > 0) == (pooling == "last")
        torch.testing.assert_close(torch.tensor(out.embedding), pooled(hidden, pooling), atol=1e-5, rtol=0)


def test_async_llm_embeds_on_its_engine_as_llm_does(tiny_model_dir):
    expected = tiny_llm(tiny_model_dir, pooling="mean").embed(PROMPT)[0].embedding

    async def run() -> list[float]:
        llm = AsyncLLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, block_size=8, pooling="mean")
        try:
            return (await llm.embed(PROMPT)).embedding
        finally:
            llm.shutdown()

    torch.testing.assert_close(torch.tensor(asyncio.run(run())), torch.tensor(expected), atol=1e-5, rtol=0)


def test_an_embedding_takes_one_sample(tiny_model_dir):
    with pytest.raises(ValueError, match="n=1"):
        SamplingParams(pooling="mean", n=2)
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="pooling"):
        LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=8, pooling="cls")


# ---------------------------------------------------------------------------------------- prompt logprobs

@pytest.mark.parametrize("options", [{}, CHUNKED], ids=["whole", "chunked"])
def test_prompt_logprobs_are_the_log_softmax_of_the_fp32_logits(tiny_model_dir, hf, options):
    llm = tiny_llm(tiny_model_dir, **options)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP))[0]
    _, logp = reference(hf, PROMPT)
    assert_prompt_logprobs(out.prompt_logprobs, PROMPT, logp)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.token_ids == out.token_ids  # the output is unchanged
    assert_pool_clean(llm)


def test_prompt_logprobs_after_a_prefix_cache_hit_are_recomputed(tiny_model_dir, hf):
    llm = tiny_llm(tiny_model_dir, **CHUNKED)
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    assert llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0].num_cached_tokens > 0
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))[0]
    assert out.num_cached_tokens == 0  # the cached prefix kept no logits: the whole prompt ran again
    _, logp = reference(hf, PROMPT)
    assert_prompt_logprobs(out.prompt_logprobs, PROMPT, logp)
    # a longer prompt sharing the cached prefix scores every position too, the shared ones included
    longer = PROMPT + [7, 8, 9, 10, 11]
    out = llm.generate([longer], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))[0]
    assert_prompt_logprobs(out.prompt_logprobs, longer, reference(hf, longer)[1])


def test_prompt_logprobs_survive_a_preemption_in_the_middle_of_the_prompt(tiny_model_dir, hf):
    # Six blocks of 8 tokens: the decoding request grows into the blocks the long prompt's later chunks need, so
    # the prompt (the queue's tail) is preempted part-way and later runs again from its first position.
    llm = tiny_llm(tiny_model_dir, num_kv_blocks=6, **CHUNKED)
    decoding = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    first, second = llm.generate([list(range(100, 108)), PROMPT], [decoding, scored])
    assert llm.engine.stats().num_preemptions > 0
    assert len(first.token_ids) == 40
    assert_prompt_logprobs(second.prompt_logprobs, PROMPT, reference(hf, PROMPT)[1])
    assert_pool_clean(llm)


def test_prompt_logprobs_of_a_batch_and_of_n_samples(tiny_model_dir, hf):
    llm = tiny_llm(tiny_model_dir, **CHUNKED)
    prompts = make_prompts(3, seed=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=2, prompt_logprobs=1))
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 2
        assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(hf, prompt)[1], top=1)


def test_a_one_token_prompt_has_only_the_leading_none(tiny_model_dir):
    out = tiny_llm(tiny_model_dir).generate([[9]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]


# ---------------------------------------------------------------------------------------- on the wire

@pytest.mark.unit
def test_prompt_results_cross_the_wire_unchanged():
    entries = (None, TokenLogprobs(7, -1.5, [(3, -0.25), (7, -1.5)], 2), TokenLogprobs(9, -0.125, [], 1))
    update = SequenceUpdate("r", 0, 11, None, None, 3, 0, prompt=PromptResult(entries, (0.5, -0.25, 0.75)))
    wire = update_to_wire(update)
    assert isinstance(wire.embedding, bytes) and len(wire.embedding) == 12 and len(wire.prompt_logprobs) == 2
    assert update_from_wire(wire) == update
    plain = SequenceUpdate("r", 0, 11)
    assert update_to_wire(plain).embedding is None and update_from_wire(update_to_wire(plain)) == plain
