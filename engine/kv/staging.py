"""Pages leaving the device while the prefill goes on: the layer-wise hand-off's copy off a GPU.

A streamed job's pages (a decode actor on another host) go out layer by layer while the prefill runs
(engine/core/prefill_engine.py). On a GPU each layer's pages must first reach host memory. Copied on the
compute stream, that copy would wait for every kernel queued before it and hold back every kernel queued
after it; copied by the sender's thread with `.cpu()`, it would also block that thread on the whole queue.
Here the copy goes on a side stream instead, behind an event recorded where the layer's KV writes were
queued, into pinned host memory: the copy engine moves layer L while the compute stream runs layer L+1, and
the sender waits only for that copy's own event.

On the CPU the pages are host memory already: they are passed on as they are, with nothing to wait for.

`StreamOps` is the slice of torch.cuda the stager uses, so the ordering is tested on the CPU with a fake.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


def _nothing_to_wait_for() -> None:
    return None


@dataclass(frozen=True)
class HostPages:
    """One layer's pages in host memory, readable once `ready()` has returned (it blocks until their copy is
    done; any thread may call it)."""
    pages: torch.Tensor
    ready: Callable[[], None] = _nothing_to_wait_for


class StreamOps(Protocol):
    """Streams, events and pinned memory of one device (CudaStreamOps; a fake in the tests)."""

    def current_stream(self) -> Any:
        """The stream the model's kernels are queued on now."""

    def new_stream(self) -> Any:
        """A stream of the device's own, for the copies (it has `wait_event(event)`)."""

    def new_event(self) -> Any:
        """An event (it has `record(stream)` and `synchronize()`)."""

    def on(self, stream: Any) -> AbstractContextManager:
        """Queue the work inside the block on `stream`."""

    def pinned(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory, which the copy engine writes without the host's help."""

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep `tensor`'s memory from reuse until the work queued on `stream` so far is done."""


class CudaStreamOps:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def on(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def pinned(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # torch's host allocator caches these

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class HostStager:
    """Takes finished pages off the device, one call per layer, in the order the layers ran."""

    def __init__(self, ops: StreamOps | None = None) -> None:
        self.ops = ops
        self._side: Any = None  # the copy stream: made on first use, so building the stager touches no GPU

    @classmethod
    def for_device(cls, device: torch.device | str) -> "HostStager":
        device = torch.device(device)
        return cls(CudaStreamOps(device) if device.type == "cuda" else None)

    @property
    def copies(self) -> bool:
        return self.ops is not None

    def stage(self, pages: torch.Tensor) -> HostPages:
        """`pages` (a view of a pool, its KV writes queued on the current stream) as host pages: on the CPU
        as they are; on a GPU a copy queued now on the side stream, to wait for with `ready()`."""
        if self.ops is None:
            return HostPages(pages)
        ops = self.ops
        if self._side is None:
            self._side = ops.new_stream()
        written = ops.new_event()
        written.record(ops.current_stream())
        host = ops.pinned(pages.shape, pages.dtype)
        copied = ops.new_event()
        with ops.on(self._side):
            self._side.wait_event(written)
            host.copy_(pages, non_blocking=True)
            copied.record(self._side)
        ops.keep_until_done(pages, self._side)  # a private pool freed before the copy ran is not reused under it
        return HostPages(host, copied.synchronize)
