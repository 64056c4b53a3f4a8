"""A model with its weights prepared for a backend, loaded through the converted-weights cache
(engine/model/weight_cache.py): mapped from the cache where an entry for this checkpoint, format, backend and
build is there, else converted once, stored, and then mapped like any later start's.

The model is built on the meta device (no storage), its layout chosen as the loader would (quant.apply_layout),
and the backend is chosen for that skeleton (its dispatch table needs only the shapes and formats), so that the
cache key is known before any weight is read. A hit fills the skeleton's parameters, its quantised weights'
scales and each product's prepared Weight (engine/backends/weight_ops.py) with views of the mapped file: nothing
is converted, dequantised or copied; only the fused decode step's state is rebuilt around them, and a backend copy
that is no plain tensor (oneDNN's packed weights) is packed again from the mapped weight. A miss converts as
loader.load_model does, prepares, writes the entry, maps it, and drops the converted copy (handing its memory
back), so that first and later starts hold the same pages.

Names in an entry: `param/<name>` (parameters and buffers), `scale/<module>` (a quantised weight's scales),
`prepared/<module>/<field>` and `prepared/head/<field>` (the prepared Weights' tensors). The notes name the fields
to pack again on a hit.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from engine.backends.base import Backend
from engine.backends.weight_ops import Weight, int8g_flat_shape
from engine.kv.host_memory import release_freed_memory
from engine.model import weight_cache
from engine.model.identity import checkpoint_key
from engine.model.layers import Linear, PreparedWeights
from engine.model.llama import LlamaModel
from engine.model.loader import ModelSource, load_model, model_class
from engine.model.progress import LOADING_WEIGHTS, PREPARING_WEIGHTS, Progress, report
from engine.model.quant import WeightChoice, apply_layout, choose_weight_dtype

log = logging.getLogger(__name__)

HEAD = "head"
# a prepared field that is no plain tensor -> the backend method that makes it again from the weight
REPACKERS = {"packed": "pack", "silu_fused": "pack_gate_up"}


class NotCacheable(Exception):
    """A prepared weight holds something the cache cannot store."""


def load_prepared(source: ModelSource, dtype: torch.dtype, weight_dtype: str, root: str | Path,
                  backend_for: Callable[[nn.Module], Backend],
                  progress: Progress | None = None) -> tuple[LlamaModel, Backend]:
    """The model on the CPU with its weights prepared for `backend_for(skeleton)`, through the cache under `root`."""
    cls = model_class(source.config)
    choice = choose_weight_dtype(weight_dtype, source.types, dtype, source.config.tie_word_embeddings,
                                 cls.parameter_name, quiet=True)
    backend = backend_for(skeleton(source, choice))
    entry = weight_cache.Entry.of(root, weight_cache.weight_key(
        checkpoint_key(source.path), dtype, _formats(choice), backend.describe(), cls.__name__))
    model = _restored(entry, source, choice, backend, progress)
    if model is not None:
        return model, backend
    with weight_cache.filling(entry, lambda: report(progress, PREPARING_WEIGHTS)) as writable:
        model = _restored(entry, source, choice, backend, progress) if writable else None  # filled meanwhile?
        if model is None:
            model = _convert(entry if writable else None, source, dtype, weight_dtype, choice, backend, progress)
    return model, backend


def skeleton(source: ModelSource, choice: WeightChoice) -> LlamaModel:
    """The model on the meta device in `choice`'s layout: shapes and formats, no storage."""
    cls = model_class(source.config)
    with torch.device("meta"):
        model = cls(source.config, "cpu")
    apply_layout(model, choice, "meta")
    return model


def _formats(choice: WeightChoice) -> list:
    return [choice.layers, choice.head, sorted(choice.modules.items())]


def _restored(entry: weight_cache.Entry, source: ModelSource, choice: WeightChoice, backend: Backend,
              progress: Progress | None) -> LlamaModel | None:
    stored = weight_cache.read(entry)
    if stored is None:
        return None
    report(progress, LOADING_WEIGHTS, 0, 1)
    try:
        model = restore(skeleton(source, choice), stored, backend)
    except (KeyError, ValueError, RuntimeError) as exc:
        log.warning("weight cache entry %s does not fit the model (%s); rebuilt", entry.index, exc)
        return None
    report(progress, LOADING_WEIGHTS, 1, 1)
    log.info("weights (%s) mapped from the cache: %s", model.weight_dtype, entry.data)
    return model


def _convert(entry: weight_cache.Entry | None, source: ModelSource, dtype: torch.dtype, weight_dtype: str,
             choice: WeightChoice, backend: Backend, progress: Progress | None) -> LlamaModel:
    """Converts and prepares the weights, stores them as `entry`, and returns the model mapped from it (the
    converted one where there is no entry to write, or it cannot be written)."""
    model = load_model(source, dtype, "cpu", weight_dtype, progress)
    report(progress, PREPARING_WEIGHTS)
    model.set_backend(backend)
    if entry is None:
        return model
    try:
        weight_cache.write(entry, *snapshot(model))
        weight_cache.prune_stale(entry, partial(_outdated, entry.key))
    except (OSError, NotCacheable) as exc:
        log.warning("converted weights not cached in %s (%s); the next start converts them again",
                    entry.directory, exc)
        return model
    mapped = _restored(entry, source, choice, backend, None)
    if mapped is None:
        return model
    converted = weakref.ref(model)
    del model
    if converted() is not None:  # held by a reference cycle: collect it now (a full collection costs 0.2 s in a
        gc.collect()             # process with a large heap, so only then)
    release_freed_memory()
    return mapped


def _outdated(current: dict, other: dict) -> bool:
    """Whether `other` is a key of the same checkpoint path, options and backend whose file identity, sources or
    torch differ: an entry no start will hit again."""
    volatile = ("checkpoint", "sources", "torch")
    same_path = other.get("checkpoint", {}).get("path") == current["checkpoint"]["path"]
    same_options = all(other.get(k) == v for k, v in current.items() if k not in volatile)
    return same_path and same_options and any(other.get(k) != current[k] for k in volatile)


# ---------------------------------------------------------------- the model's tensors, out and in

def snapshot(model: LlamaModel) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """(every tensor a prepared model runs on, by entry name; notes: the fields to pack again on a hit)."""
    tensors = {f"param/{name}": t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    tensors |= {f"scale/{name}": m.weight_scale for name, m in model.named_modules()
                if getattr(m, "weight_scale", None) is not None}
    repack: list[str] = []
    prepared = model.prepared
    weights = {name: prepared.linears[m] for name, m in model.named_modules() if isinstance(m, Linear)}
    for name, weight in [*weights.items(), (HEAD, prepared.head)]:
        for field in dataclasses.fields(Weight):
            value = getattr(weight, field.name)
            where = f"prepared/{name}/{field.name}"
            if _plain(value):
                tensors[where] = value
            elif isinstance(value, torch.Tensor) and field.name in REPACKERS:
                repack.append(where)
            elif value is not None:
                raise NotCacheable(f"{where} is a {type(value).__name__} {getattr(value, 'layout', '')}")
    return tensors, {"repack": repack}


def _plain(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"


def restore(model: LlamaModel, stored: weight_cache.Stored, backend: Backend) -> LlamaModel:
    """Fills a skeleton (`skeleton`) from an entry's tensors and sets its prepared weights for `backend`;
    KeyError names a tensor the entry lacks."""
    tensors = stored.tensors
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for table in (module._parameters, module._buffers):
            for leaf, value in table.items():
                if value is not None:
                    mapped = _fitting(tensors[f"param/{prefix}{leaf}"], value, f"{prefix}{leaf}")
                    table[leaf] = nn.Parameter(mapped, requires_grad=False) if table is module._parameters else mapped
        if getattr(module, "weight_scale", None) is not None:
            module.weight_scale = _fitting(tensors[f"scale/{name}"], _int8g_compacted(module.weight_scale,
                                                                                      tensors[f"scale/{name}"]),
                                           f"{name} scales")
    model.eval().requires_grad_(False)
    backend.check_dtype(model.dtype)
    repack = set(stored.notes.get("repack", ()))
    linears = {m: _weight(tensors, name, repack, backend) for name, m in model.named_modules()
               if isinstance(m, Linear)}
    head = _weight(tensors, HEAD, repack, backend)
    spec = model.decode_stack_spec(linears)
    model.prepared = PreparedWeights(backend, linears, head, None if spec is None else backend.decode_stack(*spec))
    return model


def _int8g_compacted(wanted: torch.Tensor, mapped: torch.Tensor) -> torch.Tensor:
    """The skeleton's int8g scales and offsets [2, G, N] as the load compacts them where the entry holds them so
    (quant.compact_int8g_scales): [1, ...] where the offsets were all zero, [..., ceil(G / 2), N] where pairs of
    groups shared their scales, then [N / 16, G', S, 16] where blocked; any other scales as they are."""
    if wanted.dim() != 3 or wanted.dtype != torch.float32 or wanted.shape[0] != 2 or mapped.dim() not in (3, 4):
        return wanted
    count, groups, n = int8g_flat_shape(mapped)  # the shapes only: a copy would read every mapped page
    if count == 1:
        wanted = wanted[:1]
    if groups == -(-wanted.shape[1] // 2) != wanted.shape[1]:
        wanted = wanted[:, 0::2]
    if mapped.dim() == 4 and (count, groups, n) == tuple(wanted.shape):
        wanted = torch.empty(mapped.shape, device="meta")
    return wanted


def _fitting(mapped: torch.Tensor, wanted: torch.Tensor, name: str) -> torch.Tensor:
    """`mapped` where it has the skeleton's shape; ValueError where not."""
    if mapped.shape != wanted.shape:
        raise ValueError(f"{name} is {tuple(mapped.shape)} in the entry, {tuple(wanted.shape)} in the model")
    return mapped


def _weight(tensors: Mapping[str, torch.Tensor], name: str, repack: set[str], backend: Backend) -> Weight:
    fields = {f.name: tensors.get(f"prepared/{name}/{f.name}") for f in dataclasses.fields(Weight)}
    for field, method in REPACKERS.items():
        if f"prepared/{name}/{field}" in repack:
            fields[field] = getattr(backend, method)(fields["data"])
    return Weight(**fields)
