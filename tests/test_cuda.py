"""The GPU paths on a real CUDA device: the KV quantisers' CUDA kernels against their njit twins, the engine core
with its model, KV pages and sampling on the GPU (the CUDA backend: Triton paged attention, decode steps replayed
as CUDA graphs) against the CPU engine, graphs against eager steps, and a prefill and a decode actor on the GPU
handing pages over by CUDA IPC. Skipped without CUDA (CI has none); the simulator check in test_kv_quant.py covers
the quantisers' logic there, tests/test_triton_attention.py the Triton kernels (interpreted) and
tests/test_cuda_graphs.py the graphs' bookkeeping."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine.backends import CudaBackend, GpuConfig, TorchBackend
from engine.config import EngineConfig
from engine.core.builder import build_engine_core, build_prefill_engine
from engine import AsyncLLM, SamplingParams
from engine.sampling.sampler import SamplingBatch, dense_distribution, process_logits, warm_dense
from engine.kernels import (build_cuda_kernels, cpu_kernels, dequantize_fp4, dequantize_fp8, quantize_fp4,
                            quantize_fp8)
from tests.kv_quant_cudasim_check import cpu_map, gpu_map, make_pages, same_bits, scalar_cases
from tests.test_engine import GREEDY, assert_pool_clean, make_prompts, tiny_llm
from tests.test_disagg_inprocess import run_disaggregated
from tests.test_kv_staging import OPTIONS as OPTIONS_STAGING, RecordingSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_scalar_helpers_on_the_gpu_match_njit_bit_for_bit():
    cpu, gpu = cpu_kernels(), build_cuda_kernels()
    for name, x in scalar_cases(np.random.default_rng(1), n_random=200_000).items():
        assert same_bits(cpu_map(cpu, name)(x), gpu_map(gpu, name)(x)), name


def round_trips(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp8 and fp4 quantisation of x and both dequantisations (to bf16 and fp32, as raw bits), on x's device."""
    codes, scales = quantize_fp8(x)
    packed, block_scales, page_scales = quantize_fp4(x)
    out = {"codes": codes, "scales": scales, "packed": packed, "block_scales": block_scales,
           "page_scales": page_scales}
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        out[f"fp8 to {dtype}"] = dequantize_fp8(codes, scales, dtype).view(bits)
        out[f"fp4 to {dtype}"] = dequantize_fp4(packed, block_scales, page_scales, dtype).view(bits)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_quantisers_on_cuda_tensors_match_the_cpu_bit_for_bit(dtype):
    """Pages with subnormals, ties, saturation, inf and NaN (make_pages), the SmolLM2 page shape, through the
    torch API: CUDA tensors take the CUDA kernels on torch's stream, CPU tensors the njit ones."""
    pages = torch.from_numpy(make_pages(np.random.default_rng(2), (48, 16, 3, 64))).to(dtype)
    want, got = round_trips(pages), round_trips(pages.cuda())
    assert all(t.is_cuda for t in got.values())
    for key in want:
        assert torch.equal(got[key].cpu(), want[key]), key


def cuda_llm(model_dir, **options):
    llm = tiny_llm(model_dir, **options)
    llm.engine = build_engine_core(llm.config, device="cuda")  # LLM builds its in-process engine on the CPU
    return llm


# The smallest top-2 log-probability gap of this model on these prompts, on the CPU: 2.6e-3 with fp32 pages,
# 1.4e-3 with fp8, 5e-4 with fp4; the GPU's fp32 sums differ from the CPU's by ~1e-6.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp4"])
def test_engine_on_cuda_generates_what_the_cpu_engine_does(tiny_model_dir, kv_cache_dtype):
    """Model, KV pages (fp32, or quantised by the CUDA kernels) and sampler on the GPU, fp32 with TF32 off as
    torch defaults: the CPU engine's greedy tokens and log-probabilities, and a clean pool afterwards."""
    assert not torch.backends.cuda.matmul.allow_tf32
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = make_prompts(8)
    options = dict(max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)  # chunks mixed with decode rows
    cpu, gpu = tiny_llm(tiny_model_dir, **options), cuda_llm(tiny_model_dir, **options)
    assert gpu.engine.kv_cache.data.is_cuda
    want, got = cpu.generate(prompts, params), gpu.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
            assert np.allclose([v for _, v in lg.top], [v for _, v in lw.top], atol=1e-4)
    assert_pool_clean(gpu)


def test_bf16_engine_on_cuda_is_deterministic_and_frees_every_block(tiny_model_dir):
    """bf16, the GPU's default serving dtype (its sums differ from the CPU kernels', so no token comparison)."""
    gpu = cuda_llm(tiny_model_dir, dtype="bfloat16", max_num_batched_tokens=64, enable_prefix_caching=False)
    assert gpu.engine.kv_cache.data.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    first, again = gpu.generate(make_prompts(8), params), gpu.generate(make_prompts(8), params)
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in first)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]  # same steps, same shapes, same bits
    assert_pool_clean(gpu)


def test_decode_steps_replayed_as_cuda_graphs_give_the_eager_steps_tokens(tiny_model_dir):
    """fp32, the same engine options but --cuda-graphs: the Triton backend in both, graphs captured for every
    bucket up to max_num_seqs and replayed, the same greedy tokens (padding rows write no page: pools clean)."""
    options = dict(max_num_batched_tokens=64, max_num_seqs=8)
    graphed, eager = cuda_llm(tiny_model_dir, **options), cuda_llm(tiny_model_dir, cuda_graphs="off", **options)
    runner = graphed.engine.runner
    assert isinstance(runner.backend, CudaBackend) and runner.backend.captures_decode
    assert runner.graphs is not None and runner.graphs.plan.sizes == (1, 2, 4, 8)
    assert eager.engine.runner.graphs is None
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(7)  # 7 rows: bucket 8 pads one
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert runner.graphs.replays[8] > 0
    assert_pool_clean(graphed)
    assert_pool_clean(eager)


def test_enforce_eager_on_cuda_runs_plain_torch_to_the_cpu_tokens(tiny_model_dir):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(4)
    gpu = cuda_llm(tiny_model_dir, enforce_eager=True)
    assert type(gpu.engine.runner.backend) is TorchBackend and gpu.engine.runner.graphs is None
    want = [o.token_ids for o in tiny_llm(tiny_model_dir).generate(prompts, params)]
    assert [o.token_ids for o in gpu.generate(prompts, params)] == want


def test_seeded_samples_on_cuda_repeat_and_do_not_depend_on_the_batch(tiny_model_dir):
    gpu = cuda_llm(tiny_model_dir)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, n=2, ignore_eos=True)
    prompt = make_prompts(1, seed=5)
    alone = gpu.generate(prompt, seeded)[0]
    in_batch = gpu.generate(make_prompts(6, seed=9) + prompt, [SamplingParams(max_tokens=12)] * 6 + [seeded])[-1]
    assert [s.token_ids for s in in_batch.outputs] == [s.token_ids for s in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids  # two samples, not one twice
    assert_pool_clean(gpu)


def test_the_compiled_sampler_distribution_gives_the_plain_values_on_cuda():
    """torch.compile'd dense_distribution (Triton kernels from inductor) against the plain ops, mixed rows."""
    dense = CudaBackend("cuda", GpuConfig(attention="triton")).fuse(dense_distribution)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9), SamplingParams(temperature=1.3, min_p=0.1),
              SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)] * 4
    batch = SamplingBatch.build(params, [None] * len(params), [()] * len(params), "cuda")
    logits = torch.randn(len(params), 32000, device="cuda") * 3
    assert warm_dense(dense, 32000, "cuda") == 4
    torch.testing.assert_close(process_logits(logits, batch, dense), process_logits(logits, batch),
                               atol=1e-6, rtol=1e-5)


def test_streamed_pages_leave_the_gpu_on_a_side_stream_and_decode_as_colocated(tiny_model_dir):
    """A prefill engine on the GPU streaming to a destination on another host: each layer's pages are copied to
    pinned host memory on the stager's side stream while later layers run; written into a GPU decode engine's
    reserved blocks they decode as a colocated GPU engine does (fp32, same kernels)."""
    options = dict(OPTIONS_STAGING, cuda_graphs="off")
    decode, colocated = cuda_llm(tiny_model_dir, **options), cuda_llm(tiny_model_dir, **options)
    prefill = build_prefill_engine(EngineConfig(model=str(tiny_model_dir), **options),
                                   source=decode.engine.source, device="cuda")
    assert prefill.stager.copies
    prompts = [p * 3 for p in make_prompts(2, seed=41)]
    sink = RecordingSink()
    want = [o.token_ids for o in colocated.generate(prompts, GREEDY)]
    outs, _ = run_disaggregated(decode, prefill, prompts, GREEDY, streamed=True, sink=sink)
    assert [o.token_ids for o in outs] == want
    assert sink.sources and all(pages.device.type == "cpu" and pages.is_pinned() for pages in sink.sources)
    assert_pool_clean(decode)


@pytest.mark.process
def test_disaggregated_actors_on_cuda_hand_pages_over_by_cuda_ipc(tiny_model_dir):
    """A prefill and a decode actor subprocess on the GPU (both on device 0): the decode actor exports its KV pool
    as a CUDA IPC handle, the prefill actor writes each prompt's pages straight into it, the decode actor carries
    on from them. Greedy outputs equal the CPU engine's (fp32, the gaps above), and the pool ends clean."""
    options = dict(dtype="float32", num_kv_blocks=256, block_size=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(8)
    want = [o.token_ids for o in tiny_llm(tiny_model_dir, **options).generate(prompts, params)]

    async def collect(llm: AsyncLLM, prompt: list[int]) -> list[int]:
        token_ids: list[int] = []
        async for out in llm.generate(prompt, params):
            token_ids = out.token_ids
        return token_ids

    async def run() -> tuple[list[str], list[list[int]], int, object]:
        llm = AsyncLLM(str(tiny_model_dir), decode_actors=1, prefill_actors=1, disagg="always",
                       devices=("cuda:0", "cuda:0"), **options)
        await llm.start()
        try:
            router = llm._client
            kinds = [h.ready.kv_export["kind"] for h in router.supervisor.handles if h.spec.role == "decode"]
            outs = await asyncio.gather(*(collect(llm, p) for p in prompts))
            while router.routed:  # finished requests are forgotten a moment after their last output
                await asyncio.sleep(0.02)
            report = await router.integrity.check(router.supervisor.ready("decode")[0].actor_id)
            return kinds, outs, router.handoff.counters.kv_transfers, report
        finally:
            await llm.aclose()

    kinds, outs, transfers, report = asyncio.run(run())
    assert kinds == ["cuda_ipc"]
    assert outs == want and transfers >= len(prompts)
    assert report.error is None and (report.used_blocks, report.reservations, report.running) == (0, 0, 0)
