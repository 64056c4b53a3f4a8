"""Sliding-window KV freeing (engine/kv/groups.py): windowed layers give back the blocks wholly outside their
window, and nothing the engine computes changes.

Layouts: which layers share which storage slot for Gemma 3 1B's shape and the tiny models. Memory: one
4096-token sequence of a tiny Gemma-3-style model holds exactly the blocks the formula counts, under half
the bytes it holds with freeing off. Outputs: greedy generations past twice the window (whole and chunked
prefill, prefix-cache hits, speculative verification, preemption, fp8 / fp4 pages, the CPU kernels) equal
those of the engine without freeing (which test_sliding_window checks against transformers), while the pool
stays consistent after every step and really holds fewer blocks in its windowed groups. Prefix hits: a
windowed group needs only the cached blocks inside its window. Hand-off: refused for a pool that frees.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.builder import build_engine_core, build_prefill_engine
from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_index import block_hash
from engine.kv.groups import NULL_BLOCK, KVGroups, blocks_in_use, first_needed_block
from engine.model.hf_loader import read_hf_config
from engine.scheduler import Scheduler, SchedulerLimits
from engine.core.sequence import Sequence
from engine.speculative.adaptive import SpecState
from engine.core.step import runner_output
from tests.kernel_helpers import require_kernels
from tests.test_sliding_window import hf_generate, random_ids
from tests.test_spec_decode import repetitive_prompts
from tests.tiny_models import tiny_gemma3_config, tiny_mistral_config, write_tiny_model

WINDOW = 8
BLOCK = 4
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 61)), [11, 12, 13], list(range(100, 113))]
CONFIGS = {"gemma3": tiny_gemma3_config, "mistral": tiny_mistral_config}


@pytest.fixture(scope="module", params=list(CONFIGS))
def windowed_dir(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), CONFIGS[request.param](), seed=1,
                            random_norms=True)


def gemma3_1b_shape() -> ModelConfig:
    """Gemma 3 1B's attention shape: 26 layers, every sixth global, the rest windowed over 512 tokens."""
    return ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                       num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512,
                       sliding_layers=tuple((i + 1) % 6 != 0 for i in range(26)))


# ---- layouts ------------------------------------------------------------------------------------------------


def test_gemma3_1b_splits_into_one_full_group_and_six_windowed_groups_of_four():
    groups = KVGroups.for_model(gemma3_1b_shape(), free_windows=True)
    assert (groups.group_size, groups.windows) == (4, (None,) + (512,) * 6)
    assert [i for i, g in enumerate(groups.layer_groups) if g == 0] == [5, 11, 17, 23]
    assert sorted(zip(groups.layer_groups, groups.layer_slots)) == sorted(set(zip(groups.layer_groups,
                                                                                   groups.layer_slots)))
    assert groups.layer_groups.count(6) == 2  # 22 windowed layers: the last group has two


def test_tiny_models_layouts(windowed_dir):
    """Gemma 3's 2 global and 4 windowed layers: groups of 2; Mistral (loaded as llama): one windowed group."""
    cfg = read_hf_config(windowed_dir)
    groups = KVGroups.for_model(cfg, free_windows=True)
    expected = {"gemma3": (2, (None, WINDOW, WINDOW)), "llama": (2, (WINDOW,))}[cfg.architecture]
    assert (groups.group_size, groups.windows) == expected
    assert KVGroups.for_model(cfg, free_windows=False) == KVGroups.single(cfg.num_layers)


def test_first_needed_block_keeps_every_key_a_later_query_sees():
    for next_query in range(0, 40):
        first = first_needed_block(next_query, WINDOW, BLOCK)
        oldest_key = max(0, next_query - WINDOW + 1)  # what the query at next_query reads first
        assert first * BLOCK <= oldest_key < (first + 1) * BLOCK


def test_the_bench_counts_gemma3_1b_bytes_per_sequence():
    """bench.window_kv: 26 layers x 2 x 256 x bf16 per token without freeing; with it, the 4 global layers'
    every token plus six 4-layer groups of the 32 blocks the window touches at 4096."""
    from bench.window_kv import kv_bytes
    cfg = gemma3_1b_shape()
    assert kv_bytes(cfg, False, 4096, 16, "auto") == 4096 * 26 * 2 * 256 * 2
    assert kv_bytes(cfg, True, 4096, 16, "auto") == (256 + 6 * 32) * 4 * 2 * 16 * 256 * 2


# ---- memory: one long sequence -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_gemma3_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3-long"),
                            tiny_gemma3_config(sliding_window=64, max_position_embeddings=8192), seed=2)


def kv_held_after_prefill(folder: Path, free: bool, prompt: list[int]) -> tuple[int, int, KVGroups]:
    """(pool blocks, KV bytes) one sequence holds once its prompt is computed, and the engine's layout."""
    llm = LLM(str(folder), dtype="float32", block_size=16, num_kv_blocks=300, free_window_kv=free)
    held = []
    step = llm.engine.step

    def step_and_measure():
        updates = step()
        if updates and not held:  # the step that computed the prompt's last chunk and sampled
            held.append(llm.engine.pool.num_used)
        return updates

    llm.engine.step = step_and_measure
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return held[0], held[0] * llm.engine.kv_cache.bytes_per_block, llm.engine.kv_cache.groups


def test_a_4k_sequence_holds_only_its_windows_blocks(long_gemma3_dir):
    prompt = random_ids(4096, 20)
    blocks_on, bytes_on, groups = kv_held_after_prefill(long_gemma3_dir, True, prompt)
    blocks_off, bytes_off, _ = kv_held_after_prefill(long_gemma3_dir, False, prompt)
    assert blocks_off == 4096 // 16
    # one full group of 256 blocks, two windowed groups of the 4 blocks that the 64-token window touches
    assert blocks_on == blocks_in_use(groups, 4096, 16) == 256 + 2 * 4
    assert bytes_on / bytes_off == pytest.approx((256 + 8) * 2 / (256 * 6))  # blocks of 2 layers against 6
    assert bytes_on < 0.35 * bytes_off


# ---- outputs: freeing changes nothing ------------------------------------------------------------------------


def generate_checked(llm, prompts, params) -> tuple[list[list[int]], int]:
    """Token ids of each prompt, with the pool's integrity checked after every step; also the most table entries
    the running sequences had given back (NULL_BLOCK) at a step's end: > 0 where freeing happened."""
    step = llm.engine.step
    given_back = [0]

    def checked_step():
        updates = step()
        llm.engine.pool.check_integrity()
        given_back[0] = max(given_back[0], sum(table.count(NULL_BLOCK) for seq in llm.engine.scheduler.running
                                               for table in seq.block_tables))
        return updates

    llm.engine.step = checked_step
    return [o.token_ids for o in llm.generate(prompts, params)], given_back[0]


def engines(folder: Path, **options) -> tuple:
    base = dict(dtype="float32", num_kv_blocks=96, block_size=BLOCK) | options
    return LLM(str(folder), free_window_kv=True, **base), LLM(str(folder), free_window_kv=False, **base)


@pytest.mark.parametrize("options", [dict(enable_chunked_prefill=False), dict(max_num_batched_tokens=6),
                                     dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp4")],
                         ids=["whole-prefill", "chunked-6", "fp8", "fp4"])
def test_freeing_keeps_greedy_outputs_past_twice_the_window(windowed_dir, options):
    freeing, keeping = engines(windowed_dir, **options)
    outs, saved = generate_checked(freeing, PROMPTS, GREEDY)
    assert outs == [o.token_ids for o in keeping.generate(PROMPTS, GREEDY)]
    assert saved > 0


def test_prefix_cache_hit_with_freeing_equals_transformers(windowed_dir):
    """The second prompt reuses the first one's 16 cached tokens (two windows): its windowed groups take only
    the cached blocks inside the window of position 16."""
    first = random_ids(18, 8)
    second = first[:16] + random_ids(5, 9)
    freeing, _ = engines(windowed_dir, max_num_batched_tokens=6)
    outs = [generate_checked(freeing, [p], GREEDY)[0][0] for p in (first, second)]
    assert freeing.engine.stats().prefix_hits >= 4
    assert outs == hf_generate(windowed_dir, [first, second], GREEDY.max_tokens)


@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_model="self:1")],
                         ids=["ngram", "self-draft"])
def test_speculative_verification_with_freeing_keeps_outputs(windowed_dir, options):
    """Rejected drafts roll back only to positions after the oldest query, whose window stays allocated."""
    prompts = repetitive_prompts(4, seed=3)
    freeing, keeping = engines(windowed_dir, num_kv_blocks=128, num_speculative_tokens=3, **options)
    outs, saved = generate_checked(freeing, prompts, GREEDY)
    assert outs == [o.token_ids for o in keeping.generate(prompts, GREEDY)]
    assert saved > 0 and freeing.engine.stats().spec_proposed > 0


def test_parallel_samples_share_the_prompt_window_with_freeing(windowed_dir):
    """n = 2: the second sample starts from the first one's cached prompt, of which its windowed groups take
    only the window; seeded samples equal the engine's without freeing."""
    params = SamplingParams(n=2, max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    prompts = [list(range(40, 61)), random_ids(19, 50)]
    freeing, keeping = engines(windowed_dir)
    outs = [[c.token_ids for c in o.outputs] for o in freeing.generate(prompts, params)]
    assert outs == [[c.token_ids for c in o.outputs] for o in keeping.generate(prompts, params)]
    assert freeing.engine.stats().prefix_hits >= 4  # the second sample's prompt blocks, per prompt
    freeing.engine.pool.check_integrity()


def test_preemption_with_freeing_recomputes_the_same_tokens(windowed_dir):
    """A pool of 8 blocks' memory, where one 52-token sequence without freeing needs 13: with freeing it fits,
    and of six sequences those that do not fit at once are preempted and recompute."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [random_ids(12, 30 + i) for i in range(6)]
    freeing, _ = engines(windowed_dir, num_kv_blocks=8, max_num_batched_tokens=8)
    _, keeping = engines(windowed_dir, max_num_batched_tokens=8)
    outs, _ = generate_checked(freeing, prompts, params)
    assert outs == [o.token_ids for o in keeping.generate(prompts, params)]
    assert freeing.engine.scheduler.num_preemptions > 0


def test_cpu_kernels_with_freeing_keep_outputs(windowed_dir):
    require_kernels(vectors=True)
    freeing, keeping = engines(windowed_dir, dtype="bfloat16")
    outs, saved = generate_checked(freeing, PROMPTS, GREEDY)
    assert outs == [o.token_ids for o in keeping.generate(PROMPTS, GREEDY)]
    assert saved > 0


# ---- prefix hits in a windowed group -------------------------------------------------------------------------


def hashes_of(tokens: list[int], n: int) -> list[int]:
    chain, parent = [], None
    for i in range(n):
        parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        chain.append(parent)
    return chain


def cached_pool(tokens: list[int], cached: dict[int, range]) -> BlockPool:
    """A two-group pool whose group g holds (CACHED) the prompt's blocks cached[g]."""
    pool = BlockPool(32, BLOCK, num_groups=2)
    chain = hashes_of(tokens, len(tokens) // BLOCK)
    for group, indices in cached.items():
        for i in indices:
            (block,) = pool.allocate(1, group)
            pool.register(block, chain[i])
            pool.free([block])
    return pool


def admit(pool: BlockPool, tokens: list[int]) -> Sequence:
    scheduler = Scheduler(pool, SchedulerLimits(64, 4), (), windows=(None, WINDOW))
    seq = Sequence(0, "r", 0, tokens, len(tokens), GREEDY, 64)
    scheduler.add([seq])
    scheduler.schedule()
    return seq


def test_a_windowed_group_hits_with_only_the_blocks_inside_its_window():
    tokens = random_ids(21, 40)  # 5 full blocks before the last token
    seq = admit(cached_pool(tokens, {0: range(5), 1: range(3, 5)}), tokens)
    assert seq.num_computed_tokens == 20
    first = first_needed_block(20, WINDOW, BLOCK)  # 3: keys 13.. are read from position 20 on
    assert seq.block_tables[1][:first] == [NULL_BLOCK] * first
    assert NULL_BLOCK not in seq.block_tables[1][first:] + seq.block_tables[0]


def test_a_gap_inside_the_window_shortens_the_hit_to_where_the_window_is_whole():
    tokens = random_ids(21, 41)
    seq = admit(cached_pool(tokens, {0: range(5), 1: [0, 1, 2, 4]}), tokens)  # group 1 lacks block 3
    # a hit of 3 blocks needs blocks 1..2 of group 1 (keys 5.. for position 12): present
    assert seq.num_computed_tokens == 12
    assert seq.block_tables[1][:first_needed_block(12, WINDOW, BLOCK)] == [NULL_BLOCK]


# ---- hand-off keeps the plain layout -------------------------------------------------------------------------


def test_a_pool_that_frees_takes_no_hand_off(windowed_dir):
    freeing, _ = engines(windowed_dir)
    if freeing.engine.kv_cache.groups.is_plain:  # Mistral: one group, refused where the decode side reserves
        with pytest.raises(ValueError, match="plain KV layout"):
            freeing.engine.scheduler.reserve_remote("r", list(range(20)), deadline=1e9)
        return
    prefill = build_prefill_engine(EngineConfig(model=str(windowed_dir), dtype="float32", num_kv_blocks=96,
                                                block_size=BLOCK), source=freeing.engine.source)
    with pytest.raises(ValueError, match="plain layout"):
        prefill.attach_pool("decode-0", freeing.engine.kv_cache)


def test_freeing_is_off_for_an_exported_pool(windowed_dir):
    def allocate(shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    from engine.core.engine_core import EngineCore
    config = EngineConfig(model=str(windowed_dir), dtype="float32", num_kv_blocks=32, block_size=BLOCK)
    core = build_engine_core(config, kv_allocator=allocate)
    assert core.kv_cache.groups == KVGroups.single(core.source.config.num_layers)
    assert core.scheduler.windows == (None,)


# ---- the scheduler with windowed groups, driven at random ------------------------------------------------------


class WindowedSchedulerMachine(RuleBasedStateMachine):
    """A scheduler over a small pool with one full and two windowed groups, run by a fake runner that keeps
    every page's tokens: each step checks that every key a chunk's queries read (all earlier positions in the
    full group, the window in the others) is in its table and holds that position's token, whether it was
    computed, found in the prefix cache or kept through preemption and speculative rollback. Between steps
    the pool is consistent and holds exactly the references the running sequences' tables name."""

    windows = (None, WINDOW, WINDOW)
    num_blocks = 48

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.num_blocks, BLOCK, num_groups=len(self.windows))
        self.scheduler = Scheduler(self.pool, SchedulerLimits(10, 3), (), windows=self.windows)
        self.pages: dict[int, dict[int, int]] = {}  # block -> slot -> token written there
        self.requests = 0

    @rule(prefix=st.sampled_from([(), tuple(range(1, 13)), tuple(range(1, 21))]), tail=st.integers(1, 9),
          max_tokens=st.integers(1, 14), speculate=st.booleans())
    def add(self, prefix: tuple[int, ...], tail: int, max_tokens: int, speculate: bool) -> None:
        self.requests += 1
        tokens = list(prefix) + [100 + self.requests * 10 + i for i in range(tail)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = Sequence(self.requests, f"r{self.requests}", 0, tokens, len(tokens), params,
                       len(tokens) + max_tokens, spec=SpecState.start(3) if speculate else None)
        self.scheduler.add([seq])

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        sched = self.scheduler.schedule()
        sched = replace(sched, chunks=tuple(self._with_drafts(c, data) for c in sched.chunks))
        for chunk in sched.chunks:
            self._check_reads(chunk)
            self._write(chunk)
        self.scheduler.update(sched, self._result(sched, data))

    @precondition(lambda self: self.scheduler.by_request)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.scheduler.abort(data.draw(st.sampled_from(sorted(self.scheduler.by_request))))

    def _with_drafts(self, chunk, data: st.DataObject):
        if not chunk.num_spec_slots:
            return chunk
        drafts = tuple(data.draw(st.lists(st.integers(0, 50), max_size=chunk.num_spec_slots)))
        return replace(chunk, token_ids=chunk.token_ids + drafts, num_draft=len(drafts))

    def _check_reads(self, chunk) -> None:
        """Every key the chunk's queries read before its own tokens is in place, with the right token."""
        known = self.scheduler.running_tokens(chunk.seq_id)
        for table, window in zip(chunk.block_tables, self.windows):
            first_key = 0 if window is None else max(0, chunk.start_pos - window + 1)
            for j in range(first_key, chunk.start_pos):
                block = table[j // BLOCK]
                assert block != NULL_BLOCK, f"key {j} of a chunk at {chunk.start_pos} was given back"
                assert self.pages.get(block, {}).get(j % BLOCK) == known[j], f"key {j} holds another token"

    def _write(self, chunk) -> None:
        for table in chunk.block_tables:
            for pos, token in enumerate(chunk.token_ids, chunk.start_pos):
                assert table[pos // BLOCK] != NULL_BLOCK
                self.pages.setdefault(table[pos // BLOCK], {})[pos % BLOCK] = token

    def _result(self, sched, data: st.DataObject):
        sampled, verified = {}, {}
        for chunk in sched.chunks:
            own = (chunk.seq_id * 7 + chunk.start_pos + len(chunk.token_ids)) % 50
            if chunk.num_draft:
                accepted = data.draw(st.integers(0, chunk.num_draft))
                verified[chunk.seq_id] = list(chunk.token_ids[1:1 + accepted]) + [own]
            elif chunk.sample:
                sampled[chunk.seq_id] = own
        return runner_output(sampled, verified=verified)

    @invariant()
    def pool_holds_what_the_tables_name(self) -> None:
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for seq in self.scheduler.running:
            assert len({len(t) for t in seq.block_tables}) == 1
            for group, (table, window) in enumerate(zip(seq.block_tables, self.windows)):
                nulls = [i for i, b in enumerate(table) if b == NULL_BLOCK]
                assert nulls == (list(range(seq.released_blocks)) if window is not None else [])
                live = [b for b in table if b != NULL_BLOCK]
                assert all(self.pool.states.group_of(b) == group for b in live)
                refs.update(live)
        assert all(self.pool.refcount(b) == refs[b] for b in range(self.num_blocks))


TestWindowedScheduler = WindowedSchedulerMachine.TestCase
TestWindowedScheduler.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
