"""One device check of the GPU path, in one run, written to one JSON file.

    python -m bench.gpu_check [--out bench/results/gpu_check.json] [--budget-s 450]
    python -m bench.gpu_check --dry-run [--batches 1,2] [--steps 2] [--tests PATH ...]   (no GPU needed)

On a CUDA device, part by part (each part's failure is recorded in "errors" and the next part runs; the JSON is
rewritten after every part, so a run cut short keeps what it measured; a part that would start past --budget-s
is recorded as skipped):
- hbm: device-to-device copy bandwidth (the decode bound's denominator), and matmul: a bf16 GEMM's FLOP/s (the
  prefill roofline), both measured here;
- models: the default model (bf16 weights) and a random-weight Llama-3.2-1B shape (bench/real_shapes.py), each
  built as `serve` builds an engine (CUDA backend, CUDA graphs captured at start-up): decode tok/s at each
  --batches size with CUDA graphs on and off, each against its HBM bound (weights read once a step plus every
  row's KV, at the bandwidth measured above), and a --prefill-tokens prompt's prefill against the GEMM rate,
  then the same prompt streamed as for a decode actor on another host (its pages leaving layer by layer, copied
  off the GPU on a side stream, against device views copied by the sink's thread), over the plain prefill;
- attention: the decode kernels alone at batch 64 (Triton, and FlashInfer where it imports: the measurement
  --gpu-attention's choice rests on);
- sampler: the sampler's distribution at the largest batch over a 128k vocabulary, plain against compiled
  (torch.compile through the CUDA backend), and the start-up seconds of compiling it;
- ipc: a KV pool exported by CUDA IPC, written by another process through its handle: GB/s, and the owner's
  check that the bytes arrived;
- tests: tests/test_cuda.py and tests/test_triton_attention.py (the kernels compiled) under pytest;
- goals: the issue's targets, read off the figures above.

--dry-run (the default where no CUDA device exists) runs every part on the CPU at small sizes, so that a first GPU
run has nothing left to debug but the GPU: host memory copies and GEMMs, two tiny random models instead of the
real ones, the Triton kernels in the interpreter (TRITON_INTERPRET=1, fp32) behind the same CUDA backend, CUDA
graphs through the runner's CPU stand-in for a capture, the IPC hand-off through a shared-memory pool, and the
tests given by --tests. Its figures mean nothing; its JSON has every key a GPU run's has.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable

import torch

from bench.prefill_rate import prefill_flops
from bench.provenance import provenance

GPU_TESTS = ("tests/test_cuda.py", "tests/test_triton_attention.py")
DRY_TESTS = ("tests/test_cuda_graphs.py::test_buckets_double_to_eight_then_step_by_eight_up_to_the_batch",)
WARM_STEPS = 2
BLOCK_SIZE = 16


class Run:
    """The results so far, written after every part, and the clock the parts are admitted by."""

    def __init__(self, out: Path, budget_s: float, header: dict[str, Any]) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.start = time.monotonic()
        self.results: dict[str, Any] = {**header, "errors": [], "skipped": [], "part_seconds": {}}

    def part(self, name: str, fn: Callable[[], Any], into: dict | None = None) -> Any:
        """fn()'s result under `name` in the results (or in `into`), None where it failed or was skipped."""
        target = self.results if into is None else into
        start = time.monotonic()
        if start > self.deadline:
            self.results["skipped"].append(name)
        else:
            try:
                target[name] = fn()
            except Exception as exc:  # one part's failure must not lose the others' figures
                self.results["errors"].append({"part": name, "error": f"{type(exc).__name__}: {exc}",
                                               "traceback": traceback.format_exc()})
            self.results["part_seconds"][name] = round(time.monotonic() - start, 1)
        self.write()
        return target.get(name)

    def write(self) -> None:
        self.results["seconds"] = round(time.monotonic() - self.start, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1) + "\n")


def sig(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: a CPU dry run's tiny figures stay non-zero."""
    return float(f"{value:.{digits}g}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_hbm(device: torch.device, nbytes: int) -> dict[str, Any]:
    """A device copy reads and writes every byte: 2 * nbytes moved per copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=10)
    return {"bytes": nbytes, "gb_per_s": sig(2 * nbytes / seconds / 1e9)}


def measure_matmul(device: torch.device, n: int, dtype: torch.dtype) -> dict[str, Any]:
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    seconds = timed(lambda: a @ b, device, repeats=5)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": sig(2 * n ** 3 / seconds / 1e12)}


# ---------------------------------------------------------------- models


def model_paths(args: argparse.Namespace) -> dict[str, Path]:
    """The default model and the 1B shape (written once into --shapes-dir), or two tiny stand-ins (dry run)."""
    from bench.real_shapes import SHAPES, Shape, generate
    from engine.model.gguf_loader import default_model_path

    if not args.dry_run:
        return {"default": default_model_path(),
                "llama-3.2-1b": generate(SHAPES["llama-3.2-1b"], "llama-3.2-1b", "safetensors", args.shapes_dir)}
    tiny = dict(model_type="llama", intermediate=128, vocab=49152, tied=True, context=2048, rope_theta=10000.0,
                rms_norm_eps=1e-5)
    return {"default": generate(Shape("tiny default", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, **tiny),
                                "tiny-default", "safetensors", args.shapes_dir),
            "llama-3.2-1b": generate(Shape("tiny 1b", layers=2, hidden=64, heads=8, kv_heads=2, head_dim=8, **tiny),
                                     "tiny-1b", "safetensors", args.shapes_dir)}


def build_engine(path: Path, args: argparse.Namespace, device: torch.device):
    """The engine `serve` would build; in a dry run, the same engine on the CPU with its runner rebuilt on the
    CUDA backend (Triton interpreted) and the CPU stand-in for graph capture."""
    from engine.config import EngineConfig
    from engine.core.builder import build_engine_core

    config = EngineConfig(model=str(path), dtype="float32" if args.dry_run else "bfloat16",
                          weight_dtype="bfloat16", num_kv_blocks=args.kv_blocks, block_size=BLOCK_SIZE,
                          max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
                          max_num_batched_tokens=max(args.prefill_tokens, max(args.batches) * args.prompt_tokens),
                          enable_prefix_caching=False)
    engine = build_engine_core(config, device=str(device), check_memory=False)
    if args.dry_run:
        engine.runner = dry_run_runner(engine, config)
    return engine


def dry_run_runner(engine, config):
    from engine.backends import CudaBackend, GpuConfig
    from engine.core.cuda_graphs import GraphPlan, bucket_sizes
    from engine.core.runner import ModelRunner

    backend = CudaBackend("cpu", GpuConfig(attention="triton", compile_elementwise=False), processors=1)
    plan = GraphPlan(bucket_sizes(config.max_num_seqs), -(-config.max_model_len // BLOCK_SIZE), BLOCK_SIZE,
                     capture="eager")
    return ModelRunner(engine.runner.model, engine.kv_cache, "cpu", backend, graphs=plan)


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter, less an untied embedding (a step reads only
    its rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def measure_model(name: str, path: Path, args: argparse.Namespace, device: torch.device,
                  hbm: dict | None, matmul: dict | None) -> dict[str, Any]:
    engine = build_engine(path, args, device)
    model = engine.runner.model
    graphs = engine.runner.graphs
    out = {"name": name, "path": str(path), "params": sum(p.numel() for p in model.parameters()),
           "weight_bytes_per_step": weight_bytes(model), "kv_bytes_per_token": engine.kv_cache.bytes_per_token,
           "backend": engine.runner.backend.describe(), "graph_buckets": list(graphs.plan.sizes) if graphs else [],
           "decode": []}
    for batch in args.batches:
        for graphs_on in ((True, False) if graphs is not None else (False,)):
            out["decode"].append(decode_point(engine, batch, args, graphs_on, out, hbm))
    out["graph_replays"] = dict(graphs.replays) if graphs is not None else {}
    out["prefill"] = prefill_point(engine, args.prefill_tokens, device, matmul)
    out["streamed_prefill"] = streamed_point(engine, args.prefill_tokens, device, out["prefill"]["seconds"])
    out.update(ratios(out["decode"]))
    del engine, model, graphs
    gc.collect()  # the runner's captured steps hold the model in closures: free it before the next one loads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def decode_point(engine, batch: int, args: argparse.Namespace, graphs_on: bool, model: dict,
                 hbm: dict | None) -> dict[str, Any]:
    """Seconds per step of `batch` sequences decoding (after their prefill and WARM_STEPS steps), the runner's
    graphs set aside for an eager run."""
    from engine.core.engine_core import EngineRequest
    from engine.sampling.sampling_params import SamplingParams

    runner, kept = engine.runner, engine.runner.graphs
    runner.graphs = kept if graphs_on else None
    device = torch.device(runner.device)
    rng = random.Random(batch)
    vocab = engine.source.config.vocab_size
    steps = args.steps
    params = SamplingParams(max_tokens=WARM_STEPS + steps + 2, temperature=0.0, ignore_eos=True)
    try:
        for i in range(batch):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            engine.add_request(EngineRequest(f"decode-{batch}-{graphs_on}-{i}", prompt, params))
        started: set[str] = set()
        while len(started) < batch:  # every prompt prefilled (the scheduler may spread them over steps)
            started.update(u.request_id for u in engine.step() if u.token_id is not None)
        for _ in range(WARM_STEPS):
            engine.step()
        synchronize(device)
        start = time.perf_counter()
        tokens = sum(len(engine.step()) for _ in range(steps))
        synchronize(device)
        step_s = (time.perf_counter() - start) / steps
    finally:
        engine.abort_all()
        runner.graphs = kept
    point = {"batch": batch, "graphs": graphs_on, "step_ms": sig(step_s * 1e3),
             "tok_per_s": sig(tokens / steps / step_s), "tokens_per_step": tokens / steps}
    if hbm:
        context = args.prompt_tokens + 1 + WARM_STEPS + steps / 2
        step_bytes = model["weight_bytes_per_step"] + batch * context * model["kv_bytes_per_token"]
        bound = batch / (step_bytes / (hbm["gb_per_s"] * 1e9))
        point.update(hbm_bound_tok_per_s=sig(bound), fraction_of_bound=sig(batch / step_s / bound))
    return point


def prefill_point(engine, tokens: int, device: torch.device, matmul: dict | None) -> dict[str, Any]:
    """One prompt of `tokens` tokens to its first token, in one step; FLOPs of its products and attention."""
    from engine.core.engine_core import EngineRequest
    from engine.sampling.sampling_params import SamplingParams

    rng = random.Random(tokens)
    vocab = engine.source.config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run() -> None:
        engine.add_request(EngineRequest(f"prefill-{time.perf_counter_ns()}",
                                         [rng.randrange(vocab) for _ in range(tokens)], one))
        while engine.has_unfinished_requests():
            engine.step()

    seconds = timed(run, device, repeats=2)
    flops = prefill_flops(engine.source.config, tokens)
    point = {"tokens": tokens, "seconds": sig(seconds), "tflops": sig(flops / seconds / 1e12)}
    if matmul:
        point["fraction_of_gemm"] = sig(point["tflops"] / matmul["tflops"])
    return point


class _WaitingSink:
    """A PageSink for a destination on another host whose thread (as transport.kv_stream's sender) waits for
    each layer's pages to be readable, then drops them: the prefill's cost of letting its pages leave."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            pages, ready = item
            if ready is not None:
                ready()
            self.bytes += pages.cpu().numel() * pages.element_size()  # .cpu(): a device view is copied here

    def send_pages(self, request_id, layer, block_ids, pages, bytes_per_block, ready=None) -> None:
        self.queue.put((pages, ready))

    def end(self, request_id, deadline, done) -> None:
        pass

    def cancel(self, request_id) -> None:
        pass

    def drain(self) -> None:
        self.queue.put(None)
        self.thread.join()


def streamed_point(engine, tokens: int, device: torch.device, plain_s: float) -> dict[str, Any]:
    """The same prompt prefilled for a decode actor on another host, its pages leaving layer by layer as chunks
    complete them: staged (engine.kv.staging: pinned memory, a side stream) and, for comparison, handed over as
    device views that the sink's thread copies with `.cpu()`. Seconds until every page is readable on the host,
    over the plain prefill's."""
    from engine.core.prefill_engine import PrefillEngine, PrefillJob
    from engine.core.runner import ModelRunner
    from engine.kv.staging import HostStager
    from engine.sampling.sampling_params import SamplingParams

    base = engine.runner
    prefill = PrefillEngine(engine.config, engine.source, dtype=engine.kv_cache.dtype, device=str(device),
                            runner=ModelRunner(base.model, None, device, base.backend))
    rng = random.Random(tokens)
    prompt = [rng.randrange(engine.source.config.vocab_size) for _ in range(tokens)]
    blocks = -(-tokens // engine.config.block_size)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"tokens": tokens, "plain_seconds": plain_s}
    for name, stager in (("staged", HostStager.for_device(device)), ("device_views", HostStager(None))):
        prefill.stager = stager

        def run() -> None:
            sink = _WaitingSink()
            job = PrefillJob(f"streamed-{time.perf_counter_ns()}", prompt, one, list(range(blocks)), 0, "",
                             time.monotonic() + 600)
            prefill.add_streamed(job, engine.kv_cache.kv_format, sink)
            while prefill.has_work():
                prefill.step()
            sink.drain()
            out["bytes"] = sink.bytes

        seconds = timed(run, device, repeats=2)
        out[name] = {"seconds": sig(seconds), "over_plain": sig(seconds / plain_s)}
    return out


def ratios(points: list[dict]) -> dict[str, Any]:
    """Graphs on over off per batch, and the largest batch's tok/s over batch 1's (graphs on where captured)."""
    by = {(p["batch"], p["graphs"]): p["tok_per_s"] for p in points}
    speedup = {str(b): sig(by[(b, True)] / by[(b, False)]) for b, g in by if g and (b, False) in by}
    batches = sorted({b for b, _ in by})
    best = {b: max(v for (bb, _), v in by.items() if bb == b) for b in batches}
    return {"graph_speedup": speedup, "largest_over_batch1": sig(best[batches[-1]] / best[batches[0]])}


# ---------------------------------------------------------------- attention kernels alone


def measure_attention(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The decode kernels at the 1B shape (8 KV heads x 64, 32 heads) on random pages: Triton, and FlashInfer
    where it imports."""
    from engine.backends import CudaBackend, GpuConfig
    from engine.backends.attention import AttentionMetadata
    from engine.backends.select import importable

    batch, context = (max(args.batches), 1024) if not args.dry_run else (2, 64)
    heads, kv_heads, head_dim = (32, 8, 64) if not args.dry_run else (4, 2, 16)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    blocks = batch * -(-context // BLOCK_SIZE)
    k, v = (torch.randn(blocks, BLOCK_SIZE, kv_heads, head_dim, device=device).to(dtype) for _ in range(2))
    tables = torch.randperm(blocks).view(batch, -1).tolist()
    meta = AttentionMetadata.build(BLOCK_SIZE, [(t, context) for t in tables], [], use_kernels=True, device=device)
    q = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    kinds = ["triton"] + (["flashinfer"] if importable("flashinfer") and not args.dry_run else [])
    out: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": 2 * k.numel() * k.element_size()}
    for kind in kinds:
        backend = CudaBackend(device, GpuConfig(attention=kind, compile_elementwise=False),
                              processors=1 if args.dry_run else None)
        seconds = timed(lambda: backend.decode_attention(q, k, v, meta, head_dim ** -0.5), device, repeats=5)
        out[kind] = {"us": sig(seconds * 1e6), "gb_per_s": sig(out["kv_bytes"] / seconds / 1e9)}
    out["faster"] = min(kinds, key=lambda kind: out[kind]["us"])
    return out


# ---------------------------------------------------------------- KV hand-off across processes


def measure_sampler(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The sampler's distribution over the 1B's vocabulary at the largest batch: plain torch (it skips what no
    row asks) against the CUDA backend's compiled dense_distribution, without and with top-k/top-p (the
    vocabulary sort), their largest difference, and the seconds the compile warm-up adds to start-up. A dry run
    times the branch-free function uncompiled."""
    from engine.backends import CudaBackend, GpuConfig
    from engine.sampling.sampler import SamplingBatch, dense_distribution, process_logits, warm_dense
    from engine.sampling.sampling_params import SamplingParams

    vocab, rows = (1000, 4) if args.dry_run else (128256, max(args.batches))
    backend = CudaBackend(device, GpuConfig(attention="triton", compile_elementwise=not args.dry_run),
                          processors=1 if args.dry_run else None)
    dense = backend.fuse(dense_distribution) or dense_distribution
    start = time.perf_counter()
    with torch.inference_mode():
        warm_dense(dense, vocab, device)
    synchronize(device)
    out: dict[str, Any] = {"vocab": vocab, "rows": rows, "compiled": dense is not dense_distribution,
                           "warm_up_seconds": round(time.perf_counter() - start, 2)}
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
    for name, params in (("temperature", SamplingParams(temperature=0.8)),
                         ("top_k_top_p", SamplingParams(temperature=0.8, top_k=50, top_p=0.9))):
        batch = SamplingBatch.build([params] * rows, [None] * rows, [()] * rows, device)
        with torch.inference_mode():
            plain_s = timed(lambda: process_logits(logits, batch), device, repeats=20)
            fused_s = timed(lambda: process_logits(logits, batch, dense), device, repeats=20)
            diff = (process_logits(logits, batch) - process_logits(logits, batch, dense)).abs().max().item()
        out[name] = {"plain_us": sig(plain_s * 1e6), "fused_us": sig(fused_s * 1e6),
                     "speedup": sig(plain_s / fused_s), "max_abs_diff": sig(diff)}
    return out


def measure_ipc(device: torch.device, nbytes: int) -> dict[str, Any]:
    """The owner exports a pool (CUDA IPC on a GPU, shared memory on the CPU); a spawned process maps it by its
    handle and copies pages into it; the owner checks that the last copy's bytes arrived."""
    from engine.kv.export import create_shared_pool

    pool = create_shared_pool((nbytes,), torch.uint8, str(device), tag="gpu-check")
    with tempfile.TemporaryDirectory() as socket_dir:
        try:
            if pool.export["kind"] == "shm":
                pool.serve(f"{socket_dir}/kv.sock")  # how the writer gets the pool's descriptor
            reply = _run_writer(pool.export, str(device))
            arrived = bool((pool.tensor[: 1 << 20] == reply["value"]).all().item())
        finally:
            pool.close()
    return {"kind": pool.export["kind"], "bytes": nbytes, "gb_per_s": reply["gb_per_s"], "verified": arrived}


def _run_writer(export: dict, device: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    proc = ctx.Process(target=_ipc_writer, args=(export, device, replies), daemon=True)
    proc.start()
    try:
        reply = replies.get(timeout=300)
    finally:
        proc.join(60)
    if "error" in reply:
        raise RuntimeError(f"the writer process failed: {reply['error']}")
    return reply


def _ipc_writer(export: dict, device: str, replies) -> None:
    try:
        from engine.kv.export import open_shared_pool

        pool = open_shared_pool(export)
        pages = torch.full_like(pool, 7, device=device)
        dev = torch.device(device)
        seconds = timed(lambda: pool.copy_(pages), dev, repeats=5)
        replies.put({"gb_per_s": sig(pool.numel() / seconds / 1e9), "value": 7})
    except Exception as exc:
        replies.put({"error": f"{type(exc).__name__}: {exc}"})


# ---------------------------------------------------------------- tests and goals


def run_tests(paths: list[str], budget_s: float, dry_run: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *paths]
        env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if dry_run else {}))
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(60.0, budget_s), env=env)
        if not junit.exists():
            raise RuntimeError(f"pytest exited {done.returncode} without a report: "
                               f"{(done.stdout + done.stderr)[-2000:]}")
        suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {"paths": paths, "returncode": done.returncode, "seconds": round(time.monotonic() - start, 1), **counts,
            "tail": done.stdout[-3000:]}


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on an H200: 1B decode at batch 1 within 2x of the HBM bound; batch 64 at least 10x
    batch 1; CUDA graphs at least 1.5x eager at batch 1. None where the figure is missing; "meaningful" is
    false in a dry run (its stand-ins are read the same way)."""
    one_b = results.get("models", {}).get("llama-3.2-1b")
    if one_b is None:
        return {}
    first = next((p for p in one_b["decode"] if p["batch"] == 1 and p["graphs"] == bool(one_b["graph_buckets"])),
                 None)
    fraction = first.get("fraction_of_bound") if first else None
    speedup = one_b["graph_speedup"].get("1")
    return {"1b_batch1_within_2x_of_hbm": None if fraction is None else fraction >= 0.5,
            "largest_batch_10x_batch1": one_b["largest_over_batch1"] >= 10,
            "graphs_1_5x_eager_at_batch1": None if speedup is None else speedup >= 1.5,
            "meaningful": not results["dry_run"]}


def header(args: argparse.Namespace, argv: list[str] | None, device: torch.device) -> dict[str, Any]:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    return {**provenance("gpu_check", argv), "dry_run": args.dry_run, "device": name, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU stand-ins at small sizes (default without CUDA)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="no part starts after this many seconds")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="decode batch sizes (default 1,16,64; dry run 1,2)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; dry run 2)")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="default 4096; dry run 32")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="each decoding sequence's prompt (default "
                        "128; dry run 16)")
    parser.add_argument("--tests", nargs="*", default=None, help="pytest paths (default: the CUDA tests; dry "
                        "run: one bookkeeping test); none to skip")
    parser.add_argument("--shapes-dir", type=Path, default=Path("bench/results/real-shapes"))
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or not torch.cuda.is_available()
    dry = args.dry_run
    args.batches = args.batches or ([1, 2] if dry else [1, 16, 64])
    args.steps = args.steps or (2 if dry else 32)
    args.prefill_tokens = args.prefill_tokens or (32 if dry else 4096)
    args.prompt_tokens = args.prompt_tokens or (16 if dry else 128)
    args.tests = list(DRY_TESTS if dry else GPU_TESTS) if args.tests is None else args.tests
    sequence = args.prompt_tokens + WARM_STEPS + args.steps + 4
    args.max_model_len = max(args.prefill_tokens, sequence) + 64
    args.kv_blocks = 2 * -(-(max(args.batches) * sequence + args.prefill_tokens + 64) // BLOCK_SIZE)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton first decorates the kernels
    device = torch.device("cpu" if args.dry_run else "cuda")
    run = Run(args.out, args.budget_s, header(args, argv, device))
    hbm = run.part("hbm", lambda: measure_hbm(device, (64 if args.dry_run else 2048) << 20))
    matmul = run.part("matmul", lambda: measure_matmul(device, 256 if args.dry_run else 8192,
                                                       torch.float32 if args.dry_run else torch.bfloat16))
    paths = run.part("model_paths", lambda: {k: str(v) for k, v in model_paths(args).items()}) or {}
    run.results["models"] = {}
    for name, path in paths.items():
        run.part(name, lambda: measure_model(name, Path(path), args, device, hbm, matmul), into=run.results["models"])
    run.part("attention", lambda: measure_attention(args, device))
    run.part("sampler", lambda: measure_sampler(args, device))
    run.part("ipc", lambda: measure_ipc(device, (16 if args.dry_run else 1024) << 20))
    if args.tests:
        run.part("tests", lambda: run_tests(args.tests, run.deadline - time.monotonic(), args.dry_run))
    run.part("goals", lambda: goals(run.results))
    print(json.dumps({k: v for k, v in run.results.items() if k not in ("models", "tests")}, indent=1))
    print(f"wrote {args.out}")
    return run.results


if __name__ == "__main__":
    main()
