"""The layer-wise hand-off's copy off a GPU (engine.kv.staging): on the CPU the pages pass as they are; with a
device's streams (faked here, over CPU tensors) each layer's copy is queued on a side stream behind an event
recorded on the compute stream, and the sender waits for that copy only. A streamed prefill through the fake
gives the pages a plain one does, and they decode as colocated."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine import LLM
from engine.config import EngineConfig
from engine.core.builder import build_prefill_engine
from engine.kv.staging import HostStager
from tests.test_disagg_inprocess import run_disaggregated
from tests.test_engine import GREEDY, make_prompts

OPTIONS = dict(dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=16)


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait", self.name, event.name))


class FakeEvent:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeOps:
    """torch.cuda's streams and events as a log of what was queued where, over CPU tensors."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = FakeStream("compute", self.log)
        self.streams = self.events = 0
        self.on_stream = "compute"

    def current_stream(self) -> FakeStream:
        return self.compute

    def new_stream(self) -> FakeStream:
        self.streams += 1
        self.log.append(("new stream", f"side{self.streams}"))
        return FakeStream(f"side{self.streams}", self.log)

    def new_event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(f"e{self.events}", self.log)

    @contextmanager
    def on(self, stream: FakeStream):
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("leave", stream.name))

    def pinned(self, shape, dtype) -> torch.Tensor:
        self.log.append(("pinned", tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    def keep_until_done(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("keep", stream.name))


def test_on_the_cpu_pages_pass_as_they_are():
    stager = HostStager.for_device("cpu")
    pages = torch.arange(24.0).view(2, 3, 4)
    staged = stager.stage(pages)
    assert not stager.copies and staged.pages is pages
    assert staged.ready() is None


def test_a_cuda_stager_is_built_without_touching_the_device():
    assert HostStager.for_device("cuda:0").copies  # no stream is made until the first page is staged


def test_each_layer_is_copied_on_one_side_stream_behind_the_compute_streams_event():
    ops = FakeOps()
    stager = HostStager(ops)
    pool = torch.randn(3, 2, 6, 4)
    first = stager.stage(pool[0, :, 1:4])
    second = stager.stage(pool[1, :, 1:4])
    assert ops.log == [
        ("new stream", "side1"),  # once, on the first page
        ("record", "e1", "compute"), ("pinned", (2, 3, 4)),
        ("enter", "side1"), ("wait", "side1", "e1"), ("record", "e2", "side1"), ("leave", "side1"),
        ("keep", "side1"),
        ("record", "e3", "compute"), ("pinned", (2, 3, 4)),
        ("enter", "side1"), ("wait", "side1", "e3"), ("record", "e4", "side1"), ("leave", "side1"),
        ("keep", "side1")]
    assert torch.equal(first.pages, pool[0, :, 1:4]) and torch.equal(second.pages, pool[1, :, 1:4])
    assert first.pages.data_ptr() != pool.data_ptr() and first.pages.is_contiguous()
    del ops.log[:]
    second.ready()
    assert ops.log == [("synchronize", "e4")]  # the sender waits for its own copy, not the compute stream


class RecordingSink:
    """A PageSink that waits for each layer's copy, as the stream sender's thread does, and keeps the pages."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, list[int], torch.Tensor]] = []  # pages cloned once ready
        self.sources: list[torch.Tensor] = []  # the pages as given
        self.ended: list[str] = []

    def send_pages(self, request_id, layer, block_ids, pages, bytes_per_block, ready=None) -> None:
        if ready is not None:
            ready()
        self.sent.append((request_id, layer, list(block_ids), pages.clone()))
        self.sources.append(pages)

    def end(self, request_id, deadline, done) -> None:
        self.ended.append(request_id)

    def cancel(self, request_id) -> None:
        raise AssertionError(f"{request_id} was cancelled")

    def pages_of(self, request_id: str) -> list[tuple[int, list[int], bytes]]:
        """(layer, destination blocks, read_pages' bytes) of each send for the request, in order."""
        return [(layer, ids, pages.contiguous().view(torch.uint8).numpy().tobytes())
                for rid, layer, ids, pages in self.sent if rid == request_id]


def test_a_streamed_prefill_staged_through_side_streams_decodes_as_colocated(tiny_model_dir):
    """Chunks of 16 tokens over 8-token blocks: the pages go out layer by layer as chunks complete them, each
    copied on the side stream; written into the decode side's reserved blocks they decode as colocated."""
    decode = LLM(str(tiny_model_dir), **OPTIONS)
    engine = decode.engine
    prefill = build_prefill_engine(EngineConfig(model=str(tiny_model_dir), **OPTIONS), source=engine.source)
    ops = FakeOps()
    prefill.stager = HostStager(ops)
    prompts = [p * 3 for p in make_prompts(2, seed=41)]  # several chunks each
    colocated = LLM(str(tiny_model_dir), **OPTIONS).generate(prompts, GREEDY)
    sink = RecordingSink()
    outs, _ = run_disaggregated(decode, prefill, prompts, GREEDY, streamed=True, sink=sink)
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
    num_layers = engine.kv_cache.data.shape[0]
    per_request = {rid: sum(len(ids) for r, layer, ids, _ in sink.sent if r == rid and layer == 0)
                   for rid in ("d0", "d1")}
    assert per_request == {f"d{i}": -(-len(p) // 8) for i, p in enumerate(prompts)}  # every block, once
    assert len({layer for _, layer, _, _ in sink.sent}) == num_layers
    assert len(sink.sent) > 2 * num_layers  # a prompt's pages went out in more than one chunk
    copies = [e for e in ops.log if e[0] == "keep"]
    waits = [e for e in ops.log if e[0] == "synchronize"]
    assert len(copies) == len(waits) == len(sink.sent) and ops.streams == 1
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0
