"""Throughput of the njit KV page quantisers (engine.kernels) against a plain torch copy of the same bytes.

    python -m bench.kv_quant_throughput [--pages 4096] [--shape 16,3,64] [--threads 2] [--repeats 9]
        [--small 1,8,64] [--json OUT]

Pages are [block_size, kv_heads, head_dim] bf16 (default: SmolLM2-135M's page per layer, K or V). Each
operation runs --repeats times after a warm-up call (which also compiles or loads the numba cache); the
median wall time is reported, and the minimum (the figure least disturbed by other processes). GB/s is
input bytes / time (bf16 pages for encoders, codes + scales for decoders); "bf16 pages" GB/s is the bf16
page bytes / time for every row, the figure to compare with the copy, which moves the same bf16 bytes.
4096 pages (25 MB) stay in this CPU's last-level cache between repeats; --pages 65536 (400 MB) measures
from DRAM. --small also times batches of a few pages (per-call latency, where fixed costs dominate). The
1-min load average is printed before and after: other processes on this machine change the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numba
import torch

from engine.kernels import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8


def run_times(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: compiles or loads the numba cache, faults the pages in
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(num_pages: int, shape: tuple[int, int, int], repeats: int) -> list[dict]:
    """One row per operation on num_pages pages of `shape` in bf16."""
    x = torch.randn(num_pages, *shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    page_bytes = nbytes(x)
    codes, scales = quantize_fp8(x)
    packed, block_scales, page_scales = quantize_fp4(x)
    copy_dst = torch.empty_like(x)
    fp8_out, fp4_out = torch.empty_like(x), torch.empty_like(x)
    ops = [
        ("torch copy (bf16)", lambda: copy_dst.copy_(x), page_bytes),
        ("fp8 encode", lambda: quantize_fp8(x, out=(codes, scales)), page_bytes),
        ("fp8 decode -> bf16", lambda: dequantize_fp8(codes, scales, out=fp8_out), nbytes(codes, scales)),
        ("fp4 encode", lambda: quantize_fp4(x, out=(packed, block_scales, page_scales)), page_bytes),
        ("fp4 decode -> bf16", lambda: dequantize_fp4(packed, block_scales, page_scales, out=fp4_out),
         nbytes(packed, block_scales, page_scales)),
    ]
    rows = []
    for name, fn, in_bytes in ops:
        times = run_times(fn, repeats)
        seconds = statistics.median(times)
        rows.append({"op": name, "pages": num_pages, "ms": seconds * 1e3, "min_ms": min(times) * 1e3,
                     "in_GBps": in_bytes / seconds / 1e9, "bf16_GBps": page_bytes / seconds / 1e9})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'op':<20} {'pages':>6} {'ms (median)':>12} {'ms (min)':>9} {'GB/s (input)':>13} "
          f"{'GB/s (bf16 pages)':>18}")
    for r in rows:
        print(f"{r['op']:<20} {r['pages']:>6} {r['ms']:>12.3f} {r['min_ms']:>9.3f} {r['in_GBps']:>13.2f} "
              f"{r['bf16_GBps']:>18.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--shape", default="16,3,64", help="block_size,kv_heads,head_dim")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--small", default="1,8,64", help="also time these page counts ('' to skip)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    shape = tuple(int(v) for v in args.shape.split(","))
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    megabytes = args.pages * 2 * shape[0] * shape[1] * shape[2] / 1e6
    print(f"{args.pages} pages of {list(shape)} bf16 ({megabytes:.1f} MB), {args.threads} threads (torch and "
          f"numba), median of {args.repeats}; load average {load_before:.2f} on {os.cpu_count()} CPUs")
    rows = measure(args.pages, shape, args.repeats)
    for small in [int(v) for v in args.small.split(",") if v]:
        rows += measure(small, shape, max(args.repeats, 50))
    print_rows(rows)
    print(f"numba threading layer: {numba.threading_layer()}; load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": shape, "threads": args.threads, "load_before": load_before,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
