"""Engine counters that only the decode actors know (speculation, adaptive KV compression) reach the router's
stats through the heartbeats, and per-request speculation counts reach the caller through the token rows."""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.core.treatment import Treatment
from engine.speculative.adaptive import SpecCounts
from tests.test_actors import assert_clean, wait_for
from tests.test_engine import make_prompts
from tests.test_kv_compress import BLOCKS, KEEP

pytestmark = pytest.mark.asyncio(loop_scope="module")
# A pool that runs short on 16 concurrent prompts (as in test_kv_compress), with prompt-lookup speculation.
OPTIONS = dict(dtype="float32", num_kv_blocks=BLOCKS, block_size=8, max_num_batched_tokens=64, speculative="ngram",
               kv_compress="fp4", kv_compress_after=KEEP)
REPEAT = [7, 8, 9, 10, 11, 12] * 6
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def actors(tiny_model_dir):
    llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, **OPTIONS)
    await llm.start()
    yield llm
    await llm.aclose()


async def final_output(llm: AsyncLLM, prompt, treatment: Treatment = Treatment()):
    out = None
    async for out in llm.generate(prompt, PARAMS, treatment=treatment):
        pass
    return out


def spec_totals(llm: AsyncLLM) -> SpecCounts:
    stats = llm.stats()
    return SpecCounts(stats.spec_proposed, stats.spec_accepted, stats.spec_steps)


async def test_speculation_counts_reach_the_request_and_the_router_stats(actors):
    decode = actors._client.supervisor.ready("decode")[0]
    await wait_for(lambda: decode.load is not None, 5, "the first heartbeat")
    before = spec_totals(actors)  # the actor's start-up calibration may have speculated already
    outs = await asyncio.gather(*(final_output(actors, REPEAT[i:] + REPEAT[:i]) for i in range(3)))
    counts = sum((o.spec for o in outs), SpecCounts())
    assert counts.num_draft_proposed > 0 and 0 <= counts.num_draft_accepted <= counts.num_draft_proposed
    await assert_clean(actors)
    expected = before + counts  # cumulative counters: the next heartbeat covers these requests too
    await wait_for(lambda: spec_totals(actors) == expected, 5, f"a heartbeat with {expected}")
    stats = actors.stats()
    assert 0 < stats.spec_accepted <= stats.spec_proposed


async def test_a_request_told_not_to_speculate_does_not(actors):
    out = await final_output(actors, REPEAT, Treatment(speculate=False))
    assert out.spec is None and len(out.token_ids) == PARAMS.max_tokens


async def test_compression_counters_reach_the_router_stats(actors):
    outs = await asyncio.gather(*(final_output(actors, p, Treatment(compress_first=i == 0))
                                  for i, p in enumerate(make_prompts(16))))
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    await wait_for(lambda: actors.stats().kv_compressions > 0, 5, "compressions in the heartbeat")
    stats = actors.stats()
    assert stats.kv_blocks_cold_total > 0 and 0 <= stats.kv_blocks_compressed <= stats.kv_blocks_cold_total
    await assert_clean(actors)
    await wait_for(lambda: actors.stats().kv_blocks_compressed == 0, 5, "compressed pages to be freed")
