"""Start-up, resident memory and batch-1 decode of the embedded LLM on random-weight checkpoints of real shapes.

    python -m bench.real_size --shapes llama-3.2-1b,llama-3.2-3b --formats q4_k_m,q8_0,bf16 [--out DIR]
        [--tokens 32] [--kv-cache-memory 256MiB] [--threads N] [--quick]

Per shape and format, the checkpoint is written by bench/real_shapes.py (kept where it exists), then two fresh
processes start `LLM(model=path)` one after the other on one new, empty --cache-dir: the first converts the
weights into the kernels' layout and fills the converted-weights cache, the second maps them (a warm start).
Each process reports:
- start-up to ready: the seconds `LLM(...)` takes (the process's imports before it are not counted). The kernel
  dispatch table, measured once per machine and model shape, is kept in DIR/dispatch-cache across runs: the first
  start of a shape's first run on a machine also measures it (`dispatch_measured` in the JSON);
- resident memory (RSS) after load and after the decode run, against the weights as the kernels read them (every
  tensor the model and its prepared products hold, packed copies included) plus the KV pool: their ratio; and
  the engine's ratio, of what `LLM(...)` and the decode run added to the RSS of the process with its imports
  (the interpreter with torch: about 0.3 GiB whatever the model);
- batch-1 decode ms/token: greedy, `--tokens` tokens after the first, by the difference of two runs; and its bound:
  the bytes a decode step reads (each product's weight and scales as its one-row kernel reads them) over the copy
  bandwidth measured in the same process right after that round (bench/offline_throughput.py
  measure_copy_bandwidth), and the fraction of that bound reached; beside it the same fraction against a plain read
  of memory (`torch.sum`, measure_read_bandwidth), the stream a decode step's products are. The shared host's
  bandwidth can move by half from one second to the next, so each of three rounds is paired with its own
  measurements: the table gives the medians of the rounds' ms/token, bandwidths and fractions.
The table goes to stdout and every figure to DIR/real_size.json. --quick: a tiny Llama shape as Q4_K_M, 4 tokens,
a 16 MiB pool (what the test runs). The machine is shared: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.real_shapes import FORMATS, LLAMA3_ROPE, SHAPES, Shape, _choices, generate
from engine.backends.dispatch_store import KIND as DISPATCH_KIND

QUICK_SHAPE = Shape("tiny-llama", "llama", layers=2, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64,
                    vocab=49152 + 64, tied=True, context=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                    rope_scaling=LLAMA3_ROPE)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
MiB = 1 << 20


# ---------------------------------------------------------------- one start, in its own process

def child(model: str, cache_dir: str, tokens: int, kv_bytes: int, threads: int | None) -> dict[str, Any]:
    import psutil

    from bench.offline_throughput import measure_copy_bandwidth, measure_read_bandwidth
    from engine import LLM, SamplingParams

    process = psutil.Process()
    entries = set((Path(cache_dir) / "weights").glob("*.index"))  # a start that converts writes one more
    tables = set((Path(cache_dir) / DISPATCH_KIND).glob("*.entry"))
    rss_base = process.memory_info().rss  # the interpreter with torch and the engine imported
    start = time.perf_counter()
    llm = LLM(model, cache_dir=cache_dir, kv_cache_memory=kv_bytes, num_threads=threads, max_num_seqs=4)
    ready_s = time.perf_counter() - start
    rss_load = process.memory_info().rss
    engine = llm.engine
    weights, step = resident_weight_bytes(engine.runner.model), step_bytes(engine.runner.model)
    kv = engine.kv_cache.data.numel() * engine.kv_cache.data.element_size()
    bandwidths = {"bandwidth_gbps": lambda: measure_copy_bandwidth(256, 3).best_gb_s,
                  "read_gbps": lambda: measure_read_bandwidth(256, 3).best_gb_s}
    rounds = decode_rounds(llm, SamplingParams, tokens, bandwidths)
    rss_decode = process.memory_info().rss
    decode_ms, bandwidth, read = (statistics.median(r[key] for r in rounds)
                                  for key in ("decode_ms", "bandwidth_gbps", "read_gbps"))
    bound_ms = step / (bandwidth * 1e9) * 1e3
    roofline = statistics.median(step / (r["bandwidth_gbps"] * 1e9) * 1e3 / r["decode_ms"] for r in rounds)
    of_read = statistics.median(step / (r["read_gbps"] * 1e9) * 1e3 / r["decode_ms"] for r in rounds)
    measured = set((Path(cache_dir) / DISPATCH_KIND).glob("*.entry")) != tables
    cached = set((Path(cache_dir) / "weights").glob("*.index")) == entries != set()
    return {"cache_hit": cached, "dispatch_measured": measured, "ready_s": ready_s, "rss_base": rss_base,
            "rss_load": rss_load, "rss_decode": rss_decode, "weights": weights, "kv": kv,
            "ratio_load": rss_load / (weights + kv), "ratio_decode": rss_decode / (weights + kv),
            "ratio_decode_engine": (rss_decode - rss_base) / (weights + kv),
            "step_bytes": step, "decode_ms": decode_ms, "bandwidth_gbps": bandwidth, "bound_ms": bound_ms,
            "roofline": roofline, "read_gbps": read, "of_read_bound": of_read, "rounds": rounds,
            "weight_dtype": engine.runner.model.weight_dtype}


def decode_rounds(llm, params_class, tokens: int, bandwidths: dict[str, Any],
                  rounds: int = 3) -> list[dict[str, float]]:
    """Greedy batch-1 decode, each round (time of 1 + tokens tokens - time of 1 token) / tokens, followed at once
    by each of `bandwidths` (name: a function giving GB/s) for that round's bounds."""
    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate([PROMPT], params_class(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    timed(2)  # warm-up: kernels, dispatch, pages touched
    out = []
    for _ in range(rounds):
        decode_ms = (timed(1 + tokens) - timed(1)) / tokens * 1e3
        out.append({"decode_ms": decode_ms, **{name: measure() for name, measure in bandwidths.items()}})
    return out


def _tensors(model) -> list:
    """Every tensor the model and its prepared products hold (parameters, buffers, scales, backend copies)."""
    import dataclasses

    import torch

    from engine.backends.weight_ops import Weight
    found = [*model.parameters(), *model.buffers()]
    found += [m.weight_scale for m in model.modules() if getattr(m, "weight_scale", None) is not None]
    prepared = model.prepared
    for weight in [*prepared.linears.values(), prepared.head]:
        found += [getattr(weight, f.name) for f in dataclasses.fields(Weight)]
    return [t for t in found if isinstance(t, torch.Tensor)]


def resident_weight_bytes(model) -> int:
    """Bytes of the weights as the kernels read them: each distinct tensor once."""
    import torch

    seen, total = set(), 0
    for tensor in _tensors(model):
        key = (tensor.data_ptr() if tensor.layout == torch.strided else id(tensor), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def step_bytes(model) -> int:
    """Bytes a batch-1 decode step reads: each product's weight, scales and bias (the LM head's too), as the
    one-row kernels read them (the GEMV reads the plain weight, not its packed copy)."""
    prepared = model.prepared
    total = 0
    for weight in [*prepared.linears.values(), prepared.head]:
        for tensor in (weight.data, weight.scale, weight.bias):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------- the run

def measure(path: Path, tokens: int, kv_bytes: int, threads: int | None, work: Path) -> dict[str, Any]:
    """A first and a warm start on one fresh cache directory (removed afterwards)."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    # the kernel dispatch table is measured once per machine and model shape, not per run: it is shared
    shared = work / "dispatch-cache" / DISPATCH_KIND
    shared.mkdir(parents=True, exist_ok=True)
    (cache / DISPATCH_KIND).symlink_to(shared.resolve(), target_is_directory=True)
    try:
        return {run: _start(path, cache, tokens, kv_bytes, threads) for run in ("first", "warm")}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _start(path: Path, cache: Path, tokens: int, kv_bytes: int, threads: int | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.real_size", "--child", str(path), "--cache-dir", str(cache),
           "--tokens", str(tokens), "--kv-cache-memory", str(kv_bytes)] + (["--threads", str(threads)] if threads
                                                                           else [])
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict[str, Any]]) -> str:
    head = ("| shape | format | weights as loaded | first start s | warm start s | RSS after load / decode (MiB) | "
            "weights + KV (MiB) | RSS ratio load / decode | engine's ratio | decode ms/token | bound ms | of bound | "
            "copy GB/s | of read bound | read GB/s |")
    lines = [head, "|" + "---|" * 15]
    for r in results:
        first, warm = r["first"], r["warm"]
        lines.append(f"| {r['shape']} | {r['format']} | {warm['weight_dtype']} | {first['ready_s']:.1f} | "
                     f"{warm['ready_s']:.1f} | {warm['rss_load'] / MiB:,.0f} / {warm['rss_decode'] / MiB:,.0f} | "
                     f"{(warm['weights'] + warm['kv']) / MiB:,.0f} | {warm['ratio_load']:.2f} / "
                     f"{warm['ratio_decode']:.2f} | {warm['ratio_decode_engine']:.2f} | {warm['decode_ms']:.1f} | "
                     f"{warm['bound_ms']:.1f} | "
                     f"{warm['roofline']:.0%} | {warm['bandwidth_gbps']:.1f} | {warm['of_read_bound']:.0%} | "
                     f"{warm['read_gbps']:.1f} |")
    return "\n".join(lines)


def run(shapes: dict[str, Shape], formats: list[str], out: Path, tokens: int, kv_bytes: int,
        threads: int | None) -> list[dict[str, Any]]:
    results = []
    for name, shape in shapes.items():
        for fmt in formats:
            path = generate(shape, name, fmt, out)
            print(f"{name} {fmt}: first and warm start ...", file=sys.stderr, flush=True)
            results.append({"shape": name, "format": fmt, **measure(path, tokens, kv_bytes, threads, out)})
    (out / "real_size.json").write_text(json.dumps(results, indent=1))
    print(table(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=lambda s: _choices(s, SHAPES, "shape"), default=["llama-3.2-1b"],
                        help=f"comma-separated: {', '.join(SHAPES)} (default: llama-3.2-1b)")
    parser.add_argument("--formats", type=lambda s: _choices(s, FORMATS, "format"), default=None,
                        help=f"comma-separated: {', '.join(FORMATS)} (default: q4_k_m,q8_0,bf16)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/real-shapes"),
                        help="folder for the checkpoints and real_size.json (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens timed (default: %(default)s)")
    parser.add_argument("--kv-cache-memory", type=int, default=256 * MiB, help="KV pool bytes (default: 256 MiB)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama shape, Q4_K_M, 4 tokens, 16 MiB pool")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.cache_dir, args.tokens, args.kv_cache_memory, args.threads)))
        return None
    if args.quick:
        shapes, formats = {"tiny-llama": QUICK_SHAPE}, args.formats or ["q4_k_m"]
        args.tokens, args.kv_cache_memory = min(args.tokens, 4), min(args.kv_cache_memory, 16 * MiB)
    else:
        shapes, formats = {n: SHAPES[n] for n in args.shapes}, args.formats or ["q4_k_m", "q8_0", "bf16"]
    args.out.mkdir(parents=True, exist_ok=True)
    return run(shapes, formats, args.out, args.tokens, args.kv_cache_memory, args.threads)


if __name__ == "__main__":
    main()
