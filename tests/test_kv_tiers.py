"""The KV tiers under an engine (engine/kv/tiers.py, the admission in engine/scheduler/blocks.py), on the tiny model:
a prefix loaded from the host or the disk tier gives exactly the output computed without it, and counts as cached;
damaged entries, another model's or KV format's entries, and a passed load deadline cost only recomputation; a
new engine on the same disk tier computes only what lies past the prefix; engines share a host tier; no block
leaks."""
from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kv.prefix_index import prefix_block_hashes
from engine.kv.tier_store import HEADER_BYTES, entry_name
from tests.tiny_models import tiny_llama_config, write_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
BS = 8
DOC_BLOCKS = 25  # a 200-token shared document
OPTIONS = dict(dtype="float32", block_size=BS, num_kv_blocks=40, max_num_batched_tokens=512)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIERS = {"host": lambda tmp: dict(kv_host_size=16 << 20), "disk": lambda tmp: dict(kv_disk_dir=str(tmp / "disk")),
         "host+disk": lambda tmp: dict(kv_host_size=16 << 20, kv_disk_dir=str(tmp / "disk"))}


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(count)]


DOC = tokens(1, DOC_BLOCKS * BS)
FIRST, SECOND = DOC + tokens(2, 21), DOC + tokens(3, 13)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Outputs computed from scratch: no prefix cache, no tiers."""
    llm = LLM(str(tiny_model_dir), **dict(OPTIONS, num_kv_blocks=256, enable_prefix_caching=False))
    return lambda prompt: llm.generate([prompt], GREEDY)[0].token_ids


def tiered(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **OPTIONS, **options)


def evict_everything(llm: LLM) -> None:
    """Run an unrelated prompt that needs every block of the pool, then wait for the write-back."""
    llm.generate([tokens(99, 40 * BS - 1)], SamplingParams(max_tokens=1))
    assert llm.engine.scheduler.tiers.flush(timeout=60)


def assert_clean(llm: LLM) -> None:
    llm.engine.pool.check_integrity()
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished_requests()


def count_prefill_tokens(llm: LLM) -> list[int]:
    """From now on, the prompt tokens each step computes (appended per step)."""
    counted: list[int] = []
    run = llm.engine.runner.run

    def counting(sched):
        counted.append(sum(len(c.token_ids) for c in sched.chunks if c.start_pos < c.num_prompt_tokens))
        return run(sched)

    llm.engine.runner.run = counting
    return counted


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_prefix_loaded_from_a_tier_gives_the_computed_output(tiny_model_dir, reference, tmp_path, tier):
    llm = tiered(tiny_model_dir, **TIERS[tier](tmp_path))
    first = llm.generate([FIRST], GREEDY)[0]
    assert first.token_ids == reference(FIRST) and first.num_cached_tokens == 0
    evict_everything(llm)
    assert llm.engine.pool.prefix.find_cached_prefix(prefix_block_hashes(DOC, BS)) == []  # nothing left in the pool
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND)
    assert second.num_cached_tokens == DOC_BLOCKS * BS
    stats = llm.engine.stats()
    loaded_from = "host" if "host" in tier else "disk"
    assert getattr(stats, f"kv_{loaded_from}_hits") == DOC_BLOCKS and stats.kv_tier_bad_entries == 0
    assert getattr(stats, f"kv_{loaded_from}_bytes_loaded") == DOC_BLOCKS * llm.engine.kv_cache.bytes_per_block
    assert_clean(llm)
    llm.engine.close()


def test_the_disk_serves_what_the_host_tier_lost(tiny_model_dir, reference, tmp_path):
    llm = tiered(tiny_model_dir, **TIERS["host+disk"](tmp_path))
    llm.generate([FIRST], GREEDY)
    evict_everything(llm)
    host = llm.engine.scheduler.tiers.stores[0].directory
    for name in os.listdir(host):
        if name.startswith("0001"):  # depths 10..19 gone from the host
            os.unlink(host / name)
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND) and second.num_cached_tokens == DOC_BLOCKS * BS
    stats = llm.engine.stats()
    assert (stats.kv_host_hits, stats.kv_disk_hits) == (DOC_BLOCKS - 10, 10)
    assert_clean(llm)
    llm.engine.close()
    assert not host.exists()  # the engine owned its host tier


def doc_entry(llm: LLM, depth: int) -> Path:
    tiers = llm.engine.scheduler.tiers
    return Path(tiers.stores[-1].directory) / entry_name(tiers.namespace, prefix_block_hashes(DOC, BS)[depth], depth)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_disk_entry_is_recomputed(tiny_model_dir, reference, tmp_path, damage):
    llm = tiered(tiny_model_dir, kv_disk_dir=str(tmp_path / "disk"))
    llm.generate([FIRST], GREEDY)
    evict_everything(llm)
    entry = doc_entry(llm, 5)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 17] ^= 0x40
        entry.write_bytes(bytes(data))
    elif damage == "truncate":
        entry.write_bytes(bytes(data[:len(data) // 2]))
    else:
        entry.unlink()
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND)
    assert second.num_cached_tokens == 5 * BS  # the blocks before the damaged one
    assert llm.engine.stats().kv_tier_bad_entries == (0 if damage == "remove" else 1)
    assert_clean(llm)
    llm.engine.close()


def test_a_new_engine_on_the_same_disk_tier_computes_only_past_the_prefix(tiny_model_dir, reference, tmp_path):
    disk = dict(kv_disk_dir=str(tmp_path / "disk"))
    before = tiered(tiny_model_dir, **disk)
    before.generate([FIRST], GREEDY)  # its blocks stay in its pool: close writes them back
    before.engine.close()
    after = tiered(tiny_model_dir, **disk)
    counted = count_prefill_tokens(after)
    second = after.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND)
    assert second.num_cached_tokens == DOC_BLOCKS * BS
    assert sum(counted) == len(SECOND) - DOC_BLOCKS * BS
    assert_clean(after)
    after.engine.close()


def test_another_model_or_kv_format_never_reads_the_entries(tiny_model_dir, reference, tmp_path):
    disk = dict(kv_disk_dir=str(tmp_path / "disk"))
    writer = tiered(tiny_model_dir, **disk)
    writer.generate([FIRST], GREEDY)
    writer.engine.close()
    other_dir = write_tiny_model(tmp_path / "other", tiny_llama_config(num_key_value_heads=2,
                                                                       max_position_embeddings=1024), seed=8)
    for model, options in [(other_dir, {}), (tiny_model_dir, dict(kv_cache_dtype="fp8"))]:
        llm = tiered(model, **disk, **options)
        out = llm.generate([SECOND], GREEDY)[0]
        assert out.num_cached_tokens == 0 and llm.engine.stats().kv_disk_hits == 0
        plain = LLM(str(model), **dict(OPTIONS, num_kv_blocks=256, enable_prefix_caching=False), **options)
        assert out.token_ids == plain.generate([SECOND], GREEDY)[0].token_ids
        llm.engine.close()


def test_quantised_pages_come_back_exactly(tiny_model_dir, tmp_path):
    fp8 = dict(kv_cache_dtype="fp8")
    computed = tiered(tiny_model_dir, **fp8).generate([FIRST, SECOND], GREEDY)  # the pool holds the prefix
    llm = tiered(tiny_model_dir, kv_host_size=16 << 20, **fp8)
    llm.generate([FIRST], GREEDY)
    evict_everything(llm)
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.num_cached_tokens == DOC_BLOCKS * BS and second.token_ids == computed[1].token_ids
    assert_clean(llm)
    llm.engine.close()


def test_loads_stop_at_their_deadline(tiny_model_dir, reference, tmp_path):
    llm = tiered(tiny_model_dir, kv_host_size=16 << 20, kv_tier_load_timeout=1.0)
    llm.generate([FIRST], GREEDY)
    evict_everything(llm)
    ticks = itertools.count()
    llm.engine.scheduler.tiers.clock = lambda: 0.4 * next(ticks)  # each look at the clock is 0.4 s later
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.num_cached_tokens == 2 * BS  # the third block's turn came after the deadline
    assert second.token_ids == reference(SECOND)
    assert_clean(llm)
    llm.engine.close()


def test_engines_share_a_host_tier_and_store_the_same_prefix_soundly(tiny_model_dir, reference, tmp_path):
    owner = tiered(tiny_model_dir, kv_host_size=16 << 20)
    host = owner.engine.scheduler.tiers.stores[0].directory
    neighbour = tiered(tiny_model_dir, kv_host_size=16 << 20, kv_host_dir=str(host))
    owner.generate([FIRST], GREEDY)
    neighbour.generate([FIRST], GREEDY)  # the same prefix computed by both
    evict_everything(owner)
    evict_everything(neighbour)  # ... and written back by both
    second = neighbour.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND) and second.num_cached_tokens == DOC_BLOCKS * BS
    store = neighbour.engine.scheduler.tiers.stores[0]
    entries = store.scan()
    assert sum(e.size for e in entries) == store.usage()  # one entry per block, counted once
    for llm in (owner, neighbour):
        assert llm.engine.stats().kv_tier_bad_entries == 0
        assert_clean(llm)
    neighbour.engine.close()
    assert host.is_dir()  # an attached engine leaves it
    owner.engine.close()
    assert not host.exists()


@pytest.mark.parametrize("entries", [0, 6])
def test_a_disk_tier_too_small_for_the_prefix_costs_only_recomputation(tiny_model_dir, reference, tmp_path, entries):
    block_entry = HEADER_BYTES + 2 * 2 * BS * 2 * 16 * 4  # this model's block: 2 layers, k and v, 2 heads of 16, fp32
    llm = tiered(tiny_model_dir, kv_disk_dir=str(tmp_path / "disk"), kv_disk_size=max(entries * block_entry, 100))
    assert llm.engine.kv_cache.bytes_per_block + HEADER_BYTES == block_entry
    llm.generate([FIRST], GREEDY)
    evict_everything(llm)
    second = llm.generate([SECOND], GREEDY)[0]
    assert second.token_ids == reference(SECOND)
    store = llm.engine.scheduler.tiers.stores[0]
    assert store.usage() <= entries * block_entry and len(store.scan()) <= entries
    assert second.num_cached_tokens <= entries * BS
    assert_clean(llm)
    llm.engine.close()
