"""Adaptive KV compression (--kv-compress fp4): old full pages move to an FP4 region instead of preempting."""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.core.builder import build_engine_core, build_prefill_engine
from engine.kv.export import create_shared_pool, open_shared_pool
from commands.args import add_engine_args, engine_options
from engine.backends.attention import AttentionMetadata
from engine.kv.block_pool import TieredBlockPool
from engine.kv.block_states import BlockState, BlockStateError, NoFreeBlocksError
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.core.engine_core import EngineCore, EngineRequest
from engine.kernels import dequantize_fp4, quantize_fp4
from engine.kv.cache import KVCache
from engine.kv.compress import ColdRegion
from engine.kv.formats import PageWrites
from tests.test_disagg_inprocess import run_disaggregated
from tests.test_engine import GREEDY, make_prompts

BS = 8
KEEP = 16  # kv_compress_after: two blocks of 8
OPTIONS = dict(dtype="float32", block_size=BS, max_num_batched_tokens=64)
BLOCKS = 48  # the memory of 48 fp32 blocks: plain serving of 16 prompts preempts; adaptive: 24 hot + 166 FP4 blocks
TINY_GEOMETRY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32)


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(model_dir, **options) -> EngineCore:
    return build_engine_core(EngineConfig(model=str(model_dir), **{**OPTIONS, "num_kv_blocks": BLOCKS, **options}))


def adaptive_engine(model_dir, **options) -> EngineCore:
    return make_engine(model_dir, kv_compress="fp4", kv_compress_after=KEEP, **options)


def run(engine: EngineCore, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Every prompt through the engine at once; the output token ids in prompt order."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while engine.has_unfinished_requests():
        for update in engine.step():
            if update.token_id is not None:
                tokens[update.request_id].append(update.token_id)
    return list(tokens.values())


def assert_clean(engine: EngineCore) -> None:
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0 and engine.pool.num_compressed == 0
    assert not engine.has_unfinished_requests()


def watch(engine: EngineCore) -> dict[str, int]:
    """Check every step as it is scheduled: the newest KEEP tokens of each sequence are in hot blocks, chunks
    carry their sequence's current table, the pools are consistent. Returns, per request, the index of the
    first output token computed from a compressed page (filled in as the run goes)."""
    first_cold: dict[str, int] = {}
    schedule, pool, sched = engine.scheduler.schedule, engine.pool, engine.scheduler

    def checked_schedule():
        out = schedule()
        pool.check_integrity()
        seqs = {s.seq_id: s for s in sched.running}
        for seq in seqs.values():
            cold = [i for i, b in enumerate(seq.block_ids) if pool.is_cold(b)]
            assert all((i + 1) * BS <= seq.num_tokens - KEEP for i in cold), (seq.num_tokens, cold)
        for chunk in out.chunks:
            seq = seqs[chunk.seq_id]
            assert chunk.block_table == tuple(seq.block_ids)
            if any(pool.is_cold(b) for b in chunk.block_table):
                first_cold.setdefault(seq.request_id, seq.num_output_tokens)
        watch.max_compressed = max(watch.max_compressed, pool.num_compressed)
        return out

    watch.max_compressed = 0
    engine.scheduler.schedule = checked_schedule
    return first_cold


def agreement_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    """Greedy outputs with a pool large enough for everything: no preemption, no compression."""
    return run(make_engine(tiny_model_dir, num_kv_blocks=512), make_prompts(16))


# ----------------------------------------------------------------------------------- the engine

def test_compression_replaces_preemption_and_keeps_the_newest_tokens_hot(tiny_model_dir, reference):
    prompts = make_prompts(16)
    plain = make_engine(tiny_model_dir)
    assert run(plain, prompts) == reference  # preemption by recompute is exact
    assert plain.stats().num_preemptions > 0

    engine = adaptive_engine(tiny_model_dir)
    assert (engine.pool.num_blocks, engine.pool.cold.num_blocks) == (24, 166)  # 48 * 4096 B: half hot, half FP4
    first_cold = watch(engine)
    outs = run(engine, prompts)
    stats = engine.stats()
    print(f"\nadaptive: {stats.kv_compressions} pages compressed, at most {watch.max_compressed} at once, "
          f"{stats.num_preemptions} preemptions (plain: {plain.stats().num_preemptions}); first output token "
          f"computed from FP4 pages per request: {first_cold}")
    assert stats.num_preemptions == 0
    assert stats.kv_compressions > 0 and watch.max_compressed > 0
    assert stats.kv_blocks_cold_total == 166
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert len(first_cold) >= 4  # several sequences really decoded from compressed pages
    for i, (out, ref) in enumerate(zip(outs, reference)):
        n = first_cold.get(f"r{i}", len(ref))
        assert out[:n] == ref[:n], f"request {i} differs before any of its pages was compressed"
    assert_clean(engine)


def test_compressing_only_old_pages_beats_an_all_fp4_pool(tiny_model_dir, reference):
    prompts = make_prompts(16)
    adaptive = [agreement_length(a, b) for a, b in zip(run(adaptive_engine(tiny_model_dir), prompts), reference)]
    all_fp4 = [agreement_length(a, b) for a, b in
               zip(run(make_engine(tiny_model_dir, num_kv_blocks=512, kv_cache_dtype="fp4"), prompts), reference)]
    print(f"\ngreedy agreement with fp32 KV over 24 tokens: adaptive {adaptive} (sum {sum(adaptive)}), "
          f"all-fp4 {all_fp4} (sum {sum(all_fp4)})")
    # measured: adaptive sum 278, all-fp4 sum 125 (this random model's greedy choices are near ties)
    assert sum(adaptive) > sum(all_fp4)
    assert sum(n >= 8 for n in adaptive) >= 10


def test_fp8_hot_region_compresses_to_fp4(tiny_model_dir):
    engine = adaptive_engine(tiny_model_dir, kv_cache_dtype="fp8")
    outs = run(engine, make_prompts(16))
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert engine.stats().kv_compressions > 0 and engine.stats().num_preemptions == 0
    assert_clean(engine)


def test_abort_with_compressed_pages_frees_both_regions(tiny_model_dir):
    engine = adaptive_engine(tiny_model_dir)
    for i, prompt in enumerate(make_prompts(16)):
        engine.add_request(EngineRequest(f"r{i}", prompt, GREEDY))
    while engine.pool.num_compressed == 0:
        engine.step()
    engine.abort_request("r3")
    engine.step()
    engine.pool.check_integrity()
    engine.abort_all()
    assert_clean(engine)


def test_without_compression_the_pool_is_unchanged(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    assert type(engine.pool).__name__ == "BlockPool" and engine.scheduler.compactor is None
    assert engine.runner.cold is None
    assert engine.stats().kv_blocks_compressed == engine.stats().kv_blocks_cold_total == 0


# ----------------------------------------------------------------------------------- hand-off

def test_hand_off_into_an_adaptive_decode_engine(tiny_model_dir):
    """A prefill engine writes the decode engine's exported (hot) pool; the decode side compresses later."""
    prompts = make_prompts(8, seed=31)
    hot = sum(-(-len(p) // BS) for p in prompts) + 4  # room for every prompt, not for 24 more tokens each
    pools = []

    def allocate(shape, dtype):
        pools.append(create_shared_pool(shape, dtype, tag="test-compress"))
        return pools[0].tensor

    config = EngineConfig(model=str(tiny_model_dir), kv_compress="fp4", kv_compress_after=KEEP,
                          **{**OPTIONS, "num_kv_blocks": 2 * hot, "max_num_batched_tokens": 512})
    engine = build_engine_core(config, kv_allocator=allocate)
    try:
        assert engine.kv_cache.num_blocks == hot and tuple(pools[0].tensor.shape)[2] == hot
        export = dict(pools[0].export, bytes_per_token=engine.kv_cache.bytes_per_token, kv_format="auto")
        prefill = build_prefill_engine(config, source=engine.source)
        prefill.attach_pool("decode-0", KVCache.from_export(engine.source.config, hot, BS, open_shared_pool(export),
                                                            export, prefill.dtype))
        decode = SimpleNamespace(engine=engine, tokenizer=engine.source.tokenizer)
        first_cold = watch(engine)
        outs, _ = run_disaggregated(decode, prefill, prompts, GREEDY)  # checksums verified on admission
        reference = run(make_engine(tiny_model_dir, num_kv_blocks=512), prompts)
        assert engine.stats().kv_compressions > 0 and engine.stats().num_preemptions == 0
        for i, (out, ref) in enumerate(zip(outs, reference)):
            n = first_cold.get(f"d{i}", len(ref))
            assert out.token_ids[:n] == ref[:n]
        assert_clean(engine)
    finally:
        pools[0].close()


# ----------------------------------------------------------------------------------- pages

@pytest.mark.parametrize("hot_format", ["auto", "fp8"])
def test_compressed_pages_gather_as_fp4_round_trips_beside_untouched_hot_pages(hot_format):
    hot = KVCache(TINY_GEOMETRY, 6, BS, torch.float32, kv_format=hot_format)
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(2, 2, 6 * BS, 2, 32, generator=gen) * 4  # [layer, k/v, slots, H, D]
    for (k, v), layer in zip(hot.layers, values):
        for pages, x in ((k, layer[0]), (v, layer[1])):
            if isinstance(pages, torch.Tensor):
                pages.view(-1, 2, 32).copy_(x)
            else:
                pages.write(PageWrites.build(torch.arange(6 * BS), BS), x)
    before = [(k.gather(torch.arange(6)[None]) if hot_format == "fp8" else k[None].clone()) for k, _ in hot.layers]
    cold = ColdRegion(TINY_GEOMETRY, 3, first_cold=6, block_size=BS, dtype=torch.float32)
    cold.compress(hot, [(2, 7), (5, 6)])
    table = torch.tensor([[0, 7, 3, 6, 1]])
    for (k_tiered, _), full in zip(cold.layers_over(hot), before):
        got = k_tiered.gather(table)[0]  # [5, bs, H, D]
        page = full[0]  # [6, bs, H, D]: what the hot pool held
        assert torch.equal(got[[0, 2, 4]], page[[0, 3, 1]])
        round_trip = dequantize_fp4(*quantize_fp4(page[[2, 5]]), dtype=torch.float32)
        assert torch.equal(got[[1, 3]], round_trip)
        assert not torch.equal(got[[1, 3]], page[[2, 5]])  # lossy: the check above is not vacuous


def teacher_forced(model, token_ids: list[int], compress_after: int | None) -> torch.Tensor:
    """[T, V] logits, one token per step after an 8-token prefill. With `compress_after`, every full page older
    than the newest `compress_after` tokens is compressed to FP4 before the next step reads it."""
    num_blocks = len(token_ids) // BS + 2
    hot = KVCache(model.cfg, num_blocks, BS, torch.float32)
    cold = ColdRegion(model.cfg, num_blocks, num_blocks, BS, torch.float32)
    layers = hot.layers if compress_after is None else cold.layers_over(hot)
    table = list(range(num_blocks))
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata.build(BS, [], [(table, 0, BS)])
        rows.append(model.compute_logits(model(torch.tensor(token_ids[:BS]), torch.arange(BS), meta, layers)))
        for pos in range(BS, len(token_ids)):
            if compress_after is not None:
                moves = [(b, b + num_blocks) for i, b in enumerate(table) if b < num_blocks
                         and (i + 1) * BS <= pos - compress_after]
                if moves:
                    cold.compress(hot, moves)
                    table = [b + num_blocks if (b, b + num_blocks) in moves else b for b in table]
            meta = AttentionMetadata.build(BS, [(table, pos + 1)], [])
            rows.append(model.compute_logits(model(torch.tensor([token_ids[pos]]), torch.tensor([pos]), meta,
                                                   layers)))
    return torch.cat(rows)


def test_teacher_forced_error_of_adaptive_lies_between_none_and_all_fp4(tiny_model_dir):
    model = make_engine(tiny_model_dir, num_kv_blocks=4).runner.model
    rng = random.Random(11)
    ids = [rng.randrange(3, 512) for _ in range(160)]
    ref = teacher_forced(model, ids, None).log_softmax(-1)
    adaptive = teacher_forced(model, ids, 32).log_softmax(-1)
    all_fp4 = teacher_forced(model, ids, 0).log_softmax(-1)
    kl = {name: (ref.exp() * (ref - logq)).sum(-1) for name, logq in (("adaptive", adaptive), ("fp4", all_fp4))}
    # Positions < 40 read no compressed page (the first moves once 32 newer tokens follow a full block).
    assert torch.equal(adaptive[:40], ref[:40])
    assert kl["adaptive"][40:].min() > 0
    print(f"\nteacher-forced KL mean over positions 40..159: adaptive (newest 32 hot) "
          f"{kl['adaptive'][40:].mean():.2e}, all fp4 {kl['fp4'][40:].mean():.2e}")
    assert kl["adaptive"][40:].mean() < 0.7 * kl["fp4"][40:].mean()


# ----------------------------------------------------------------------------------- bookkeeping and config

def test_tiered_pool_routes_cold_ids_and_checks_both_regions():
    pool = TieredBlockPool(4, 3, BS)
    hot = pool.allocate(2)
    cold = pool.allocate_cold(2)
    assert cold == [4, 5] and all(pool.is_cold(b) for b in cold) and not any(pool.is_cold(b) for b in hot)
    assert pool.num_used == 2 and pool.num_compressed == 2 and pool.num_available == 2
    assert pool.block_state(5) is BlockState.USED and pool.refcount(4) == 1 and pool.block_state(6) is BlockState.FREE
    assert pool.register(4, 123) is False and pool.prefix.find_cached_prefix([123]) == []
    with pytest.raises(NoFreeBlocksError):
        pool.allocate_cold(2)
    with pytest.raises(BlockStateError):
        pool.free([hot[0], 4, 4])  # a cold block freed twice: nothing is released
    assert pool.num_used == 2 and pool.num_compressed == 2
    pool.check_integrity()
    pool.free(reversed(hot + cold))
    assert pool.num_used == 0 and pool.num_compressed == 0
    pool.check_integrity()
    pool.cold.states._free.pop(0)  # corrupt the cold region: the tiered check must see it
    with pytest.raises(AssertionError):
        pool.check_integrity()


@pytest.mark.parametrize("options, match", [
    (dict(kv_compress="fp8"), "kv_compress must be one of"),
    (dict(kv_compress="int4"), "kv_compress must be one of"),
    (dict(kv_compress="fp4", kv_compress_after=-1), "kv_compress_after"),
    (dict(kv_compress="fp4", kv_compress_after=1.5), "kv_compress_after"),
    (dict(kv_compress="fp4", kv_compress_share=0.0), "kv_compress_share"),
    (dict(kv_compress="fp4", kv_compress_share=1.0), "kv_compress_share"),
    (dict(kv_compress="fp4", kv_cache_dtype="fp4"), "kv_cache_dtype auto or fp8"),
])
def test_bad_compression_settings_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_flags_map_onto_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = engine_options(parser.parse_args(["--kv-compress", "fp4", "--kv-compress-after", "64",
                                                "--kv-compress-share", "0.7"]))
    config = EngineConfig(**options)
    assert (config.kv_compress, config.kv_compress_after, config.kv_compress_share) == ("fp4", 64, 0.7)
    assert EngineConfig(**engine_options(parser.parse_args([]))).kv_compress == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-compress", "fp8"])


def test_a_budget_too_small_for_both_regions_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="both regions"):
        make_engine(tiny_model_dir, num_kv_blocks=1, kv_compress="fp4")


_ONE_THREAD_ENGINE = """
import sys, torch
torch.set_num_threads(1)
from engine.config import EngineConfig
from engine.core.builder import build_engine_core
from tests.test_kv_compress import run, OPTIONS, BLOCKS, KEEP
from tests.test_engine import make_prompts
engine = build_engine_core(EngineConfig(model=sys.argv[1], **OPTIONS, num_kv_blocks=BLOCKS, kv_compress="fp4",
                                        kv_compress_after=KEEP))
run(engine, make_prompts(16))
print(engine.stats().kv_compressions, torch.get_num_threads())
"""


@pytest.mark.process
def test_an_engine_given_one_thread_keeps_one_through_the_fp4_kernels(tiny_model_dir):
    """numba's OpenMP layer, when it starts its team (once per process), sets the calling thread's OpenMP team
    size, which is torch's and the C++ kernels' too: an actor given one core ran two threads on it after its first
    FP4 compaction. A fresh process, so that the team starts inside the engine's run."""
    done = subprocess.run([sys.executable, "-c", _ONE_THREAD_ENGINE, str(tiny_model_dir)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    compressions, threads = map(int, done.stdout.split()[-2:])
    assert compressions > 0 and threads == 1, done.stdout
