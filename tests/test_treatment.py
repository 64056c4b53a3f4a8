"""Per-quadrant treatment (speculation for SILO, compress-first for LILO) and per-request speculation counts,
from the treatment function through the engine and the wire to the server's metrics and /status."""
from __future__ import annotations

import argparse

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from actors.convert import update_from_wire, update_to_wire
from engine import LLM, AsyncLLM, SamplingParams
from engine.kv.block_pool import TieredBlockPool
from engine.kv.compaction import Compactor
from engine.config import ConfigError
from engine.core.engine_core import EngineRequest
from engine.core.treatment import Treatment
from engine.core.sequence import Sequence, SequenceStatus
from engine.speculative.adaptive import SpecCounts
from engine.core.step import SequenceUpdate
from server.app import create_app
from server.args import add_actor_args, add_server_args, server_settings
from server.quadrant import Quadrant, QuadrantThresholds, TreatmentOptions, treatment_for
from server.settings import ServerSettings
from tests.test_engine import GREEDY, make_prompts
from tests.test_kv_compress import BS, KEEP, adaptive_engine

REPEAT = [7, 8, 9, 10, 11, 12] * 6  # a repetitive prompt: prompt lookup always finds a match
THRESHOLDS = QuadrantThresholds(long_prompt_tokens=512, long_output_tokens=32)


# ---------------------------------------------------------------------------------------- treatment_for

@pytest.mark.parametrize("quadrant, options, expected", [
    (Quadrant.SILO, TreatmentOptions(speculation=True), Treatment(speculate=True, long_prompt=False)),
    (Quadrant.SISO, TreatmentOptions(speculation=True), Treatment(speculate=False, long_prompt=False)),
    (Quadrant.LISO, TreatmentOptions(speculation=True), Treatment(speculate=False, long_prompt=True)),
    (Quadrant.LILO, TreatmentOptions(speculation=True), Treatment(speculate=False, long_prompt=True)),
    (Quadrant.SISO, TreatmentOptions(speculation=True, speculate_quadrants="all"),
     Treatment(speculate=True, long_prompt=False)),
    (Quadrant.LILO, TreatmentOptions(speculation=True, speculate_quadrants="all", kv_compress=True),
     Treatment(speculate=True, compress_first=True, long_prompt=True)),
    (Quadrant.SILO, TreatmentOptions(), Treatment(long_prompt=False)),  # nothing configured: the engine's defaults
    (Quadrant.LILO, TreatmentOptions(), Treatment(long_prompt=True)),
    (Quadrant.LILO, TreatmentOptions(kv_compress=True), Treatment(compress_first=True, long_prompt=True)),
    (Quadrant.SILO, TreatmentOptions(kv_compress=True), Treatment(long_prompt=False)),
    (Quadrant.LISO, TreatmentOptions(kv_compress=True), Treatment(long_prompt=True)),
])
def test_treatment_for_each_quadrant(quadrant, options, expected):
    assert treatment_for(quadrant, options) == expected


def test_speculate_quadrants_flag_and_bad_values():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_actor_args(parser)
    assert server_settings(parser.parse_args([])).speculate_quadrants == "silo"
    assert server_settings(parser.parse_args(["--speculate-quadrants", "all"])).speculate_quadrants == "all"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculate-quadrants", "lilo"])
    with pytest.raises(ConfigError, match="speculate_quadrants"):
        TreatmentOptions(speculate_quadrants="none")
    with pytest.raises(ConfigError, match="speculate_quadrants"):
        ServerSettings(speculate_quadrants="SILO")


# ---------------------------------------------------------------------------------------- compress first

def _running(seq_id: int, pool: TieredBlockPool, num_tokens: int, compress_first: bool = False) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, list(range(num_tokens)), num_tokens - 1, GREEDY, 1000,
                   arrival_time=float(seq_id), status=SequenceStatus.RUNNING, compress_first=compress_first)
    seq.num_computed_tokens = num_tokens - 1
    seq.block_tables = [pool.allocate(-(-num_tokens // BS))]
    return seq


def test_compactor_takes_compress_first_pages_before_older_ones():
    pool = TieredBlockPool(16, 8, BS)
    early = _running(0, pool, 6 * BS)  # highest priority, oldest positions: normally compressed alongside
    late = _running(1, pool, 5 * BS, compress_first=True)
    compactor = Compactor(pool, keep_recent=KEEP)
    # late has 5 blocks, the newest KEEP tokens (two blocks) stay hot: blocks 0..2 are its candidates
    assert [c.seq for c in compactor.candidates([early, late])][:3] == [late] * 3
    moves = compactor.make_room(pool.num_available + 3, [early, late])
    assert len(moves) == 3
    assert all(pool.is_cold(b) for b in late.block_ids[:3]) and not any(pool.is_cold(b) for b in late.block_ids[3:])
    assert not any(pool.is_cold(b) for b in early.block_ids)
    # beyond what the compress-first sequence can give, the others' old pages follow, oldest first
    compactor.make_room(pool.num_available + 2, [early, late])
    assert [pool.is_cold(b) for b in early.block_ids] == [True, True, False, False, False, False]
    # all or nothing still holds: more than the cold region can take changes nothing
    before = (list(early.block_ids), list(late.block_ids), pool.num_compressed)
    assert compactor.make_room(pool.num_available + 4, [early, late]) == []
    assert (early.block_ids, late.block_ids, pool.num_compressed) == before
    pool.check_integrity()


def test_engine_compresses_a_compress_first_request_before_the_others(tiny_model_dir):
    """The adaptive engine of test_kv_compress (16 prompts, a pool that runs short): the first request, which
    would otherwise give up its pages last, is marked compress-first; every compaction takes its pages while
    it still has any old enough."""
    engine = adaptive_engine(tiny_model_dir)
    prompts = make_prompts(16)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY, treatment=Treatment(compress_first=i == 0)))
    first = engine.scheduler.by_request["r0"][0]
    compactor = engine.scheduler.compactor
    schedule, seen = engine.scheduler.schedule, []

    def checked_schedule():
        out = schedule()
        if out.compressions:
            cold_first = {b for b in first.block_ids if engine.pool.is_cold(b)}
            moved = {cold for _, cold in out.compressions}
            left = [b for b in first.block_ids[:compactor.num_compressible(first)] if not engine.pool.is_cold(b)]
            seen.append((len(moved & cold_first), len(moved), len(left)))
            assert moved <= cold_first or not left, "another request's pages went before r0's"
        return out

    engine.scheduler.schedule = checked_schedule
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and seen[0][0] == seen[0][1] > 0, seen  # the first compaction took only r0's pages
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0 and engine.pool.num_compressed == 0


# ---------------------------------------------------------------------------------------- per-request counts

def test_spec_counts_arithmetic():
    counts = SpecCounts().record(4, 3).record(2, 0)
    assert counts == SpecCounts(6, 3, 2)
    assert counts.acceptance_rate == 0.5 and counts.mean_accepted_length == 1.5
    assert counts + SpecCounts(1, 1, 1) == SpecCounts(7, 4, 3)
    assert SpecCounts().acceptance_rate == 0.0 and SpecCounts().mean_accepted_length == 0.0


def test_per_request_counts_add_up_to_the_engine_totals(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8, speculative="ngram")
    prompts = [REPEAT, REPEAT[3:] + [5, 6], make_prompts(1, seed=3)[0]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    counts = [o.spec for o in outs]
    assert all(c is not None for c in counts)
    total, stats = sum(counts, SpecCounts()), llm.engine.stats()
    assert (total.num_draft_proposed, total.num_draft_accepted, total.num_verify_steps) == \
        (stats.spec_proposed, stats.spec_accepted, stats.spec_steps)
    assert total.num_draft_proposed > 0 and 0 <= total.num_draft_accepted <= total.num_draft_proposed


def test_requests_that_do_not_speculate_report_no_counts(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8)
    assert llm.generate([REPEAT], GREEDY)[0].spec is None


def test_counts_cross_the_wire_on_the_finishing_row_only():
    final = SequenceUpdate("r", 0, 5, "length", None, 10, 0, SpecCounts(9, 4, 3))
    middle = SequenceUpdate("r", 0, 4, None, None, 10, 0)
    assert update_from_wire(update_to_wire(final)) == final
    assert update_to_wire(middle).spec is None and update_from_wire(update_to_wire(middle)) == middle


# ---------------------------------------------------------------------------------------- the server

@pytest.fixture
def ngram_llm(tiny_model_dir):
    llm = AsyncLLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8, num_threads=1,
                   speculative="ngram")
    yield llm
    llm.shutdown()


def _metric_values(text: str, name: str) -> dict[str, float]:
    """quadrant label -> value of the counter `name` (its _total sample), for the quadrants it counted in
    (every quadrant's series exists from the start, at zero)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get(name)
    return {} if family is None else {s.labels["quadrant"]: s.value for s in family.samples
                                      if s.name.endswith("_total") and s.value > 0}


async def test_only_silo_requests_speculate_and_metrics_carry_their_quadrant(ngram_llm):
    app = create_app(ngram_llm, ServerSettings(quadrants=THRESHOLDS))
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        async def complete(max_tokens: int) -> str:
            body = {"prompt": REPEAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            async with session.post(server.make_url("/v1/completions"), json=body) as resp:
                assert resp.status == 200, await resp.text()
                return resp.headers["X-Quadrant"]

        assert await complete(16) == "SISO"
        assert await complete(48) == "SILO"
        async with session.get(server.make_url("/metrics")) as resp:
            metrics = await resp.text()
        async with session.get(server.make_url("/status")) as resp:
            status = await resp.json()
    proposed = _metric_values(metrics, "phase_serve:spec_decode_num_draft_tokens")
    accepted = _metric_values(metrics, "phase_serve:spec_decode_num_accepted_tokens")
    steps = _metric_values(metrics, "phase_serve:spec_decode_num_drafts")
    assert set(proposed) == {"SILO"}, metrics  # the SISO request did not speculate at all
    assert proposed["SILO"] > 0 and 0 <= accepted["SILO"] <= proposed["SILO"] and steps["SILO"] > 0
    by_quadrant = status["speculation"]["by_quadrant"]
    assert set(by_quadrant) == {"SILO"}
    silo = by_quadrant["SILO"]
    assert (silo["proposed"], silo["accepted"], silo["steps"]) == (proposed["SILO"], accepted["SILO"], steps["SILO"])
    assert silo["acceptance_rate"] == pytest.approx(silo["accepted"] / silo["proposed"])
    assert silo["mean_accepted_length"] == pytest.approx(silo["accepted"] / silo["steps"])
    assert status["speculation"]["proposed"] == silo["proposed"]  # the engine's own totals agree


async def test_speculate_quadrants_all_lets_siso_speculate(ngram_llm):
    app = create_app(ngram_llm, ServerSettings(quadrants=THRESHOLDS, speculate_quadrants="all"))
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        body = {"prompt": REPEAT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        async with session.post(server.make_url("/v1/completions"), json=body) as resp:
            assert resp.headers["X-Quadrant"] == "SISO"
        async with session.get(server.make_url("/metrics")) as resp:
            proposed = _metric_values(await resp.text(), "phase_serve:spec_decode_num_draft_tokens")
    assert set(proposed) == {"SISO"} and proposed["SISO"] > 0


async def test_treatment_reaches_the_engine_per_request(ngram_llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    last = {}
    for name, treatment in (("off", Treatment(speculate=False)), ("on", Treatment(speculate=True))):
        async for out in ngram_llm.generate(REPEAT, params, treatment=treatment):
            last[name] = out
    assert last["off"].spec is None
    assert last["on"].spec is not None and last["on"].spec.num_draft_proposed > 0
    assert last["on"].token_ids == last["off"].token_ids  # greedy output is the same either way
