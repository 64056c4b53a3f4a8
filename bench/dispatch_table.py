"""The kernel dispatch table this machine produces (engine/backends/dispatch.py), and how long measuring it took.

    python -m bench.dispatch_table [--model PATH] [--formats bf16,int8,int4] [--max-rows 2048] [--reps 3]
                                   [--threads N] [--activation-quant] [--quick] [--json OUT]

Measures afresh, as an engine's first start on this machine does (the disk cache is neither read nor written):
each candidate kernel of each weight format, at row counts 1, 2, 4, ... up to --max-rows, on the model's layer
shapes (qkv, o, gate|up, down; random weights), the median of --reps timed runs (the kernels of a row count taking
turns) after one untimed run of each kernel. Prints the
CPU, its features and the kernels' build key; then per format the chosen route, the shipped route of the
CpuKernelConfig limits beside it, and every median (ms; `*` marks the kept kernel, `-` one not timed there: a
packed copy at one row, or a streaming kernel once it fell behind). --activation-quant lets W8A8 and W4A8 (off
by default: they fail the accuracy gate) into the candidates up to 64 rows. --quick: 16 rows, one rep.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.dispatch import FORMATS, REPS, Timings, choose_table, row_buckets
from engine.backends.dispatch_store import summary
from engine.backends.kernel_timing import KernelTimer, Workload
from engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, ModelConfig
from engine.kernels import cpu_ext
from engine.kernels.extension_build import cpu_model
from engine.model.loader import resolve_model


def layer_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """[N, K] of a decoder layer's products: the fused qkv, o, the fused gate|up, down."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return tuple(dict.fromkeys([(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q),
                                (2 * cfg.intermediate_size, cfg.hidden_size),
                                (cfg.hidden_size, cfg.intermediate_size)]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="weight formats to measure")
    parser.add_argument("--max-rows", type=int, default=OFFLINE_MAX_NUM_BATCHED_TOKENS,
                        help="largest row count (an engine measures up to its step budget)")
    parser.add_argument("--reps", type=int, default=REPS, help="timed runs per kernel and row count")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--activation-quant", action="store_true", help="W8A8 and W4A8 among the candidates")
    parser.add_argument("--quick", action="store_true", help="16 rows, one rep: checks the bench runs")
    parser.add_argument("--json", default=None, help="write the table and every time here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_rows, args.reps = 16, 1
    formats = tuple(args.formats.split(","))
    if not formats or any(f not in FORMATS for f in formats):
        parser.error(f"--formats takes some of {','.join(FORMATS)}, not {args.formats!r}")
    args.formats = formats
    return args


def print_timings(fmt: str, timings: Timings, kept) -> None:
    kernels = list(dict.fromkeys(k for times in timings[fmt].values() for k in times))
    print(f"  {'rows':>6} " + " ".join(f"{k:>10}" for k in kernels))
    for rows, times in timings[fmt].items():
        cells = [f"{times[k] * 1e3:9.3f}{'*' if kept.kernel(rows) == k else ' '}" if k in times else f"{'-':>10}"
                 for k in kernels]
        print(f"  {rows:>6} " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    workload = Workload(layer_shapes(source.config), args.formats, args.max_rows)
    config = CpuKernelConfig(max_w8a8_rows=64, max_w4a8_rows=64) if args.activation_quant else CpuKernelConfig()
    backend = CpuKernelBackend(config)
    key = cpu_ext.key()
    print(f"CPU: {cpu_model()}; features: {','.join(key.features)}; kernels: {key.name}; "
          f"torch threads: {torch.get_num_threads()}")
    print(f"workload: {source.path} layer shapes {list(workload.shapes)}, rows 1-{args.max_rows}, "
          f"median of {args.reps}")
    candidates = {fmt: backend.candidates[fmt] for fmt in workload.formats}

    def heard(done: int, total: int) -> None:
        print(f"\rmeasuring: {done}/{total} row counts", end="", file=sys.stderr, flush=True)

    start = time.perf_counter()
    table, timings = choose_table(candidates, row_buckets(args.max_rows), KernelTimer(config, workload),
                                  backend.dispatch, config.row_caps(), heard, args.reps)
    seconds = time.perf_counter() - start
    print(file=sys.stderr)
    print(f"measured in {seconds:.2f} s: {summary(table)}")
    for fmt in workload.formats:
        print(f"{fmt}: measured {table.route(fmt).describe()}; shipped {backend.dispatch.route(fmt).describe()}")
        print_timings(fmt, timings, table.route(fmt))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu_model(), "features": list(key.features), "build_key": key.name,
                       "threads": torch.get_num_threads(), "workload": workload.to_key(), "seconds": seconds,
                       "table": table.to_wire(), "shipped": backend.dispatch.to_wire(),
                       "timings": {f: {str(r): t for r, t in by.items()} for f, by in timings.items()}}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
