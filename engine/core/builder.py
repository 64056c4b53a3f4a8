"""The one place that assembles an engine from its parts: config in, engine out.

`build_engine_core` loads the model, sizes and allocates the KV pool (its memory from `kv_allocator` where an
actor exports it), builds the block pool, scheduler, runner and speculator, and hands them to EngineCore;
`build_prefill_engine` does the same for the prefill side of disaggregation, whose pools are attached later.
Each part is complete when it is built: nothing is attached to a built part afterwards. Given a `LoadedModel` (an
engine's model with the backend its weights are prepared for), either builder builds around it instead of loading:
an actor that changes role keeps its weights.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import psutil
import torch

from engine.backends import GpuConfig, select_backend
from engine.backends.base import Backend
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.dispatch import FORMATS, DispatchTable
from engine.backends.dispatch_store import measured_table
from engine.backends.kernel_timing import Workload
from engine.backends.weight_ops import weight_format
from engine.config import EngineConfig, ModelConfig
from engine.core.cuda_graphs import graph_plan
from engine.core.engine_core import EngineCore
from engine.core.prefill_engine import PrefillEngine
from engine.core.prompt_pass import SCORE_ROWS
from engine.core.runner import ModelRunner
from engine.disk_cache import DiskCache, cache_root
from engine.kv.block_pool import BlockPool, TieredBlockPool
from engine.kv.cache import KVCache, choose_num_blocks, grouped_num_blocks
from engine.kv.compaction import MIN_BATCH_SHARE, Compactor
from engine.kv.compress import ColdRegion, split_kv_budget
from engine.kv.groups import KVGroups
from engine.kv.tiers import build_tiers
from engine.model.footprint import available_memory, check_resident, engine_footprint
from engine.model.layers import Linear
from engine.model.llama import LlamaModel
from engine.model.loader import ModelSource, load_model, resolve_dtype, resolve_model
from engine.model.prepared_state import load_prepared
from engine.model.progress import (ALLOCATING_KV, BUILDING_KERNELS, LOADING_DRAFT, MEASURING_KERNELS,
                                   PREPARING_WEIGHTS, READING_CHECKPOINT, Progress, report)
from engine.sampling.structured import source_compiler
from engine.scheduler import Scheduler, SchedulerLimits
from engine.speculative.build import build_proposer
from engine.speculative.proposer import Proposer
from engine.speculative.speculator import Speculator

log = logging.getLogger(__name__)
KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class LoadedModel:
    """A model loaded once, with the backend its weights are prepared for: what the next engine of an actor that
    changes role runs on (its pools, scheduler and runner are new)."""

    source: ModelSource
    model: LlamaModel
    backend: Backend

    @staticmethod
    def of(engine: EngineCore | PrefillEngine) -> "LoadedModel":
        return LoadedModel(engine.source, engine.runner.model, engine.runner.backend)


def build_engine_core(config: EngineConfig, source: ModelSource | None = None, device: str = "cpu",
                      kv_allocator: KVAllocator | None = None, proposer: Proposer | None = None,
                      progress: Progress | None = None, check_memory: bool = True,
                      loaded: LoadedModel | None = None) -> EngineCore:
    """`kv_allocator(shape, dtype)` provides the KV pool's memory (an actor passes shared memory). `proposer`
    replaces the one `config.speculative` would build here (a decode actor's draft actor client). `progress`
    hears each stage (engine/model/progress.py). `check_memory`: refuse before the weights load when what the
    engine would hold does not fit in the memory available (engine/model/footprint.py); off where the caller
    checked a whole layout of engines already (the server, for its actors). `loaded`: run that model (nothing is
    loaded, nor checked: its weights are resident already)."""
    _set_torch_threads(config)
    torch.manual_seed(config.seed)
    report(progress, READING_CHECKPOINT)
    source = loaded.source if loaded else source or resolve_model(config.model)
    dtype = resolve_dtype(config.dtype, device)
    model_cfg = source.config
    if check_memory and loaded is None and torch.device(device).type == "cpu":
        _check_memory(source, config, dtype, kv_pool=True)
    loaded = loaded or _cached_load(config, source, dtype, device, progress)
    model = loaded.model if loaded else load_model(source, dtype, device, config.weight_dtype, progress)
    report(progress, ALLOCATING_KV)
    plain_blocks, num_cold = _kv_block_counts(config, model_cfg, dtype)
    # An exported pool (an actor's: a peer writes its pages), a compressed one and one with KV tiers below it (a
    # tier entry is a block of every layer) keep the plain layout
    groups = KVGroups.for_model(model_cfg, config.free_window_kv and kv_allocator is None and not num_cold
                                and not config.uses_kv_tiers)
    num_blocks = grouped_num_blocks(model_cfg, plain_blocks, groups)
    kv_cache = _kv_cache(config, model_cfg, num_blocks, dtype, device, kv_allocator, groups)
    tiers = build_tiers(config, source.path, kv_cache)
    evicted = None if tiers is None else tiers.write_back
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching, groups.num_groups, evicted) \
        if not num_cold else TieredBlockPool(num_blocks, num_cold, config.block_size, config.enable_prefix_caching,
                                             evicted)
    limits = SchedulerLimits(config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill,
                             config.prefill_shares(), model_cfg.attention_span, config.itl_target)
    eos = source.tokenizer.eos_token_ids or model_cfg.eos_token_ids
    scheduler = Scheduler(pool, limits, tuple(eos), _compactor(config, pool), groups.windows, tiers)
    cold = ColdRegion(model_cfg, num_cold, num_blocks, config.block_size, dtype, device) if num_cold else None
    max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)
    backend = loaded.backend if loaded else _backend(config, dtype, device, progress, model)
    graphs = graph_plan(config.cuda_graphs, device, backend, kv_cache, config.max_num_seqs, max_model_len)
    runner = ModelRunner(model, kv_cache, device, backend, grammar_compiler=partial(source_compiler, source),
                         cold=cold, graphs=graphs, progress=progress)
    if proposer is None:
        if config.speculative == "draft":
            report(progress, LOADING_DRAFT)
        proposer = build_proposer(config, model, source, plain_blocks, dtype, device)
    speculator = None if proposer is None else Speculator(proposer, model_cfg.vocab_size)
    return EngineCore(config, source, dtype=dtype, max_model_len=max_model_len, kv_cache=kv_cache, pool=pool,
                      scheduler=scheduler, runner=runner, speculator=speculator)


def build_prefill_engine(config: EngineConfig, source: ModelSource | None = None, device: str = "cpu",
                         progress: Progress | None = None, check_memory: bool = True,
                         loaded: LoadedModel | None = None) -> PrefillEngine:
    """`progress`, `check_memory` and `loaded` as build_engine_core's (a prefill engine keeps no KV pool of its
    own)."""
    _set_torch_threads(config)
    report(progress, READING_CHECKPOINT)
    source = loaded.source if loaded else source or resolve_model(config.model)
    dtype = resolve_dtype(config.dtype, device)
    if check_memory and loaded is None and torch.device(device).type == "cpu":
        _check_memory(source, config, dtype, kv_pool=False)
    loaded = loaded or _cached_load(config, source, dtype, device, progress)
    model = loaded.model if loaded else load_model(source, dtype, device, config.weight_dtype, progress)
    backend = loaded.backend if loaded else _backend(config, dtype, device, progress, model)
    runner = ModelRunner(model, None, device, backend, grammar_compiler=partial(source_compiler, source))
    return PrefillEngine(config, source, dtype=dtype, device=device, runner=runner)


def _check_memory(source: ModelSource, config: EngineConfig, dtype: torch.dtype, kv_pool: bool) -> None:
    """InsufficientMemoryError before anything loads when this engine would not fit in the memory available."""
    available = available_memory()
    check_resident(engine_footprint(source, config, dtype, available, kv_pool), available, log)


def _cached_load(config: EngineConfig, source: ModelSource, dtype: torch.dtype, device: str,
                 progress: Progress | None) -> LoadedModel | None:
    """The model and its backend through the converted-weights cache (engine/model/prepared_state.py), on the CPU
    with --weight-cache on; None elsewhere (the caller loads as it would without the cache)."""
    if config.weight_cache != "on" or torch.device(device).type != "cpu":
        return None
    model, backend = load_prepared(source, dtype, config.weight_dtype, cache_root(config.cache_dir),
                                   partial(_select_backend, config, dtype, device, progress), progress)
    return LoadedModel(source, model, backend)


def _backend(config: EngineConfig, dtype: torch.dtype, device: str, progress: Progress | None,
             model: torch.nn.Module) -> Backend:
    """The backend (its kernels built on first use, its dispatch table measured on this machine for the model's
    shapes unless --kernel-dispatch shipped), reported before the weights are prepared for it: the ModelRunner packs
    them into its layout."""
    backend = _select_backend(config, dtype, device, progress, model)
    report(progress, PREPARING_WEIGHTS)
    return backend


def _select_backend(config: EngineConfig, dtype: torch.dtype, device: str, progress: Progress | None,
                    model: torch.nn.Module) -> Backend:
    """The backend for `model` (loaded, or its meta-device skeleton: the dispatch measurement reads only its
    layers' shapes and formats), its kernels built first."""
    report(progress, BUILDING_KERNELS)
    tune = None if config.kernel_dispatch == "shipped" else partial(_measured_dispatch, config, model, progress)
    return select_backend(device, dtype, config.enforce_eager, gpu=GpuConfig(attention=config.gpu_attention),
                          tune=tune)


def _measured_dispatch(config: EngineConfig, model: torch.nn.Module, progress: Progress | None,
                       kernels: CpuKernelConfig) -> DispatchTable:
    """This machine's dispatch table for the model's layer shapes and formats up to the step budget (remembered in
    the cache; measured once)."""
    def heard(done: int, total: int) -> None:
        report(progress, MEASURING_KERNELS, done, total)

    cache = DiskCache(cache_root(config.cache_dir))
    # one LM-head product: the sampled rows and the verified drafts of a step, or a slice of a scored prompt
    head_rows = max(SCORE_ROWS, config.max_num_seqs * (1 + config.num_speculative_tokens))
    workload = kernel_workload(model, config.max_num_batched_tokens, head_rows)
    return measured_table(kernels, workload, cache, config.recalibrate, heard).table


def kernel_workload(model: torch.nn.Module, max_rows: int, head_rows: int | None = None) -> Workload:
    """What a dispatch measurement times for this model: its layers' distinct [N, K] shapes, in the formats of its
    layers and LM head, up to `max_rows` rows. A format only the LM head has (SmolLM2's Q8_0 head beside Q4_1
    layers) is timed on the head's own shape, whose route it alone follows (a 49152-row head is memory-bound where
    the layers' shapes sit in cache), up to `head_rows` rows (the most one head product takes; past them the route's
    last kernel); a head sharing its layers' format is not timed (its size would slow the largest buckets for a
    product run once a step)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    head = model.head_module()
    formats = {weight_format(m.weight, m.weight_scale) for m in layers}
    head_format = weight_format(head.weight, getattr(head, "weight_scale", None))
    own = () if head_format in formats else ((head_format, ((model.cfg.vocab_size, model.cfg.hidden_size),)),)
    formats.add(head_format)
    shapes = sorted({(m.out_features, m.in_features) for m in layers})
    own_rows = min(head_rows, max_rows) if own and head_rows is not None else None
    return Workload(tuple(shapes), tuple(f for f in FORMATS if f in formats), max_rows, own, own_rows)


def _set_torch_threads(config: EngineConfig) -> None:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)


def _kv_block_counts(config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(hot blocks, FP4 blocks): adaptive compression splits the KV budget, otherwise all of it is hot."""
    c = config
    available = psutil.virtual_memory().available
    if c.kv_compress == "none":
        return choose_num_blocks(model_cfg, c.block_size, dtype, c.num_kv_blocks, c.kv_cache_memory,
                                 available, c.kv_cache_dtype), 0
    return split_kv_budget(model_cfg, c.block_size, dtype, c.kv_cache_dtype, c.num_kv_blocks,
                           c.kv_cache_memory, available, c.kv_compress_share)


def _kv_cache(config: EngineConfig, model_cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: str,
              kv_allocator: KVAllocator | None, groups: KVGroups) -> KVCache:
    kv_format = config.kv_cache_dtype
    storage = None if kv_allocator is None else kv_allocator(
        KVCache.shape_for(model_cfg, num_blocks, config.block_size, kv_format),
        KVCache.storage_dtype(dtype, kv_format))
    return KVCache(model_cfg, num_blocks, config.block_size, dtype, device, storage, kv_format, groups)


def _compactor(config: EngineConfig, pool: BlockPool) -> Compactor | None:
    if not isinstance(pool, TieredBlockPool):
        return None
    return Compactor(pool, config.kv_compress_after, int(pool.num_blocks * MIN_BATCH_SHARE))
