"""CUDA-graph bookkeeping on the CPU (engine/core/cuda_graphs.py): the batch-size buckets, the static buffers and
their padding, which steps replay and which run eagerly, with the CPU stand-in for a capture (a replay runs the
forward again into the same output); and the runner replaying a tiny model's decode steps on the CUDA backend
(Triton interpreted) to the tokens the eager engine gives. The capture itself runs on a GPU only
(tests/test_cuda.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.triton_interpreter import kernels

kernels()  # before the backend imports them (tests/triton_interpreter.py)
from engine import SamplingParams  # noqa: E402
from engine.backends import CudaBackend, GpuConfig  # noqa: E402
from engine.backends.attention import AttentionMetadata, PrefillSegment  # noqa: E402
from engine.core.cuda_graphs import DecodeGraphs, GraphPlan, StaticInputs, bucket_for, bucket_sizes  # noqa: E402
from engine.core.runner import ModelRunner  # noqa: E402
from tests.test_engine import assert_pool_clean, make_prompts, tiny_llm  # noqa: E402


def test_buckets_double_to_eight_then_step_by_eight_up_to_the_batch():
    assert bucket_sizes(1) == (1,) and bucket_sizes(3) == (1, 2, 4) and bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert [bucket_for(n, bucket_sizes(20)) for n in (1, 3, 8, 9, 17, 24, 25)] == [1, 4, 8, 16, 24, 24, None]
    with pytest.raises(ValueError, match="at least one row"):
        bucket_sizes(0)


def step(rows: list[tuple[list[int], int]], token_ids: list[int], prefill: bool = False,
         groups: int = 1) -> SimpleNamespace:
    """A step input as the runner's prepare_input gives it: decode rows (block table, context length)."""
    meta = AttentionMetadata.build(4, rows, [])
    if prefill:
        meta.prefills.append(PrefillSegment(len(rows), 2, 0, torch.zeros(1, dtype=torch.long)))
    return SimpleNamespace(input_ids=torch.tensor(token_ids), positions=torch.tensor([n - 1 for _, n in rows]),
                           meta=meta, group_metas=(meta,) * groups)


def test_static_inputs_hold_the_rows_then_padding_that_touches_no_page():
    buffers = StaticInputs(max_rows=8, max_blocks=5, block_size=4, device="cpu")
    buffers.block_tables.fill_(99)  # left over from a wider step
    buffers.load(step([([3, 1], 6), ([7], 2), ([2, 4, 9], 9)], [11, 12, 13]), rows=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0] and buffers.positions[:4].tolist() == [5, 1, 8, 0]
    assert buffers.slot_mapping[:4].tolist() == [1 * 4 + 1, 7 * 4 + 1, 9 * 4 + 0, -1]
    assert buffers.context_lens[:4].tolist() == [6, 2, 9, 0]
    assert buffers.block_tables[:3, :3].tolist() == [[3, 1, 0], [7, 0, 0], [2, 4, 9]]
    meta = buffers.meta(4)
    assert meta.num_decode == 4 and meta.use_kernels and meta.decode_block_tables.shape == (4, 5)
    assert meta.decode_context_lens.data_ptr() == buffers.context_lens.data_ptr()  # views: the graph's addresses


class Recorder:
    """A forward that records what it is called with: hidden = 10 * token + position, one column."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, ids, positions, meta, layers):
        self.calls.append((len(ids), meta.slot_mapping.tolist()))
        return (10 * ids + positions)[:, None].float()


def test_steps_replay_in_the_smallest_bucket_and_the_rest_run_eagerly():
    layers = [object()]
    forward = Recorder()
    graphs = DecodeGraphs(GraphPlan((1, 2, 4), max_blocks=3, block_size=4, capture="eager"), forward, layers, "cpu")
    assert [rows for rows, _ in forward.calls] == [4, 2, 1]  # captured largest first, all padding
    assert all(set(slots) == {-1} for _, slots in forward.calls)
    out = graphs.run(step([([3], 2), ([5, 6], 7), ([1], 1)], [4, 8, 9]), layers)
    assert out.flatten().tolist() == [41, 86, 90] and forward.calls[-1] == (4, [13, 26, 4, -1])
    assert graphs.run(step([([2], 3)], [6]), layers).flatten().tolist() == [62]
    eager = [step([([1], 1)] * 5, [1] * 5),  # more rows than the largest bucket
             step([([1], 1)], [1], prefill=True),  # prefill rows
             step([([1], 1)], [1], groups=2),  # KV-cache groups
             step([([1, 2, 3, 4], 14)], [1])]  # a block table wider than the buffers
    assert [graphs.run(s, layers) for s in eager] == [None] * 4
    assert graphs.run(step([([1], 1)], [1]), [object()]) is None  # another pool's pages
    assert graphs.replays == {4: 1, 1: 1} and graphs.eager_steps == 5
    assert len(forward.calls) == 5  # three captures, two replays: the eager steps never reached the graphs


def test_the_runner_replays_decode_steps_to_the_eager_engines_tokens(tiny_model_dir):
    """The tiny model on the CUDA backend (Triton interpreted, nothing compiled) with decode steps captured by the
    CPU stand-in, against the same engine's eager steps: the same greedy tokens; decode steps of 3, 2 and 1 rows
    replayed in buckets 4, 2 and 1 (the padding row writes nowhere: the pool stays clean)."""
    prompts = make_prompts(3, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 5)]
    llm = tiny_llm(tiny_model_dir, max_num_seqs=4, enable_prefix_caching=False)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    backend = CudaBackend("cpu", GpuConfig(attention="triton", compile_elementwise=False), processors=1)
    plan = GraphPlan(bucket_sizes(4), max_blocks=1024 // 8, block_size=8, capture="eager")
    engine.runner = ModelRunner(engine.runner.model, engine.kv_cache, "cpu", backend, graphs=plan)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert engine.runner.graphs.replays == {4: 1, 2: 1, 1: 2}
    assert_pool_clean(llm)


def test_a_cpu_engine_captures_nothing(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    assert llm.engine.runner.graphs is None


def test_a_capture_that_fails_leaves_every_step_eager(caplog):
    def broken(ids, positions, meta, layers):
        raise RuntimeError("operation not permitted when stream is capturing")

    plan = GraphPlan((1, 2), max_blocks=2, block_size=4, capture="eager")
    assert DecodeGraphs.capture_or_none(plan, broken, [], "cpu") is None
    assert "CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
