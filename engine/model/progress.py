"""Start-up progress: how a long build (loading a model, calibrating an engine) says where it is, stage by stage.

The engine knows nobody who listens: a builder takes a `Progress` callback, or None, and calls it at each stage
and for each unit of a stage that counts them (an actor relays it to its supervisor, which gives up on an actor
only when it falls silent). Called on the building thread; it must return at once.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, TypeVar

Progress = Callable[[str, int, int], None]  # (stage, units done, units in all); 0 in all: a stage without a count

READING_CHECKPOINT = "reading the checkpoint"
LOADING_WEIGHTS = "loading weights"
ALLOCATING_KV = "allocating the KV pool"
BUILDING_KERNELS = "building kernels"
MEASURING_KERNELS = "measuring kernels"  # this machine's dispatch table (engine/backends/dispatch_store.py)
PREPARING_WEIGHTS = "preparing weights"
LOADING_DRAFT = "loading the draft model"
CALIBRATING = "calibrating"
WARMING_UP = "warming up"
CAPTURING_GRAPHS = "capturing CUDA graphs"
COMPILING_SAMPLER = "compiling the sampler"  # on a GPU (engine/sampling/sampler.py dense_distribution)
STAGE_UNITS: Mapping[str, str] = {LOADING_WEIGHTS: "tensors", CALIBRATING: "runs", CAPTURING_GRAPHS: "batch sizes",
                                 MEASURING_KERNELS: "row counts", COMPILING_SAMPLER: "variants"}

T = TypeVar("T")


def report(progress: Progress | None, stage: str, done: int = 0, total: int = 0) -> None:
    if progress is not None:
        progress(stage, done, total)


def counted(items: Iterable[T], progress: Progress | None, stage: str, total: int) -> Iterator[T]:
    """`items`, reporting `stage` with each one taken: 0/total first, then 1/total after the first, and so on."""
    report(progress, stage, 0, total)
    for done, item in enumerate(items, 1):
        yield item
        report(progress, stage, min(done, total), total)
