"""GGUF dequantisation speed: `engine.model.gguf_file.dequantize` against `gguf.quants.dequantize`.

    python -m bench.gguf_dequant [--types Q4_K,Q6_K,...] [--total-mb 1024] [--tensor-mb 64] [--reference-mb 64]
        [--repeats 3]

Each type gets one tensor of --tensor-mb MB of random blocks, rows of 4096 values, with f16 scales of the
size a real model's have (so that no product is subnormal, inf or nan). gguf's own dequantiser runs once on
its first --reference-mb MB, scaled to a GB, and ours is checked against it bit for bit. Then, after one
warm-up call, ours dequantises the whole tensor over and over until --total-mb MB of quantised data have gone
through, each output freed before the next (as the loader hands each tensor to torch in turn); the fastest
of --repeats such runs is kept. "Output write alone" is that same loop with `np.empty(...).fill(0)` of the
output's size in place of dequantising: the floor that writing the float32 values sets.

A row reports seconds per GB (2**30 bytes) of quantised data and nanoseconds per output value: types pack
2.6 to 8.5 bits a value, so a GB of Q2_K holds over three times the values of a GB of Q8_0. The warm-up
matters on a VM, where the first touch of memory the guest never used is slow; a loader pays that once per
process, for what it keeps. The 1-min load average is printed before and after: other processes on this
machine change the figures.
"""
from __future__ import annotations

import argparse
import os
import time
from types import MappingProxyType
from typing import Callable

import gguf
import numpy as np

from engine.model.gguf_file import FAST_DEQUANTIZERS, dequantize

Q = gguf.GGMLQuantizationType
GB = 2**30
ROW_VALUES = 4096
DEFAULT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the f16 fields in each type's block: its scales d (and Q4_1/Q5_1's m, the K-quants' dmin).
F16_FIELDS = MappingProxyType({
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
})


def random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int, f16_values: np.ndarray) -> np.ndarray:
    """`n_blocks` blocks of random bytes, shaped (n_blocks, type size), whose f16 fields are drawn from
    `f16_values` (float16)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        blocks[:, at:at + 2] = rng.choice(f16_values, n_blocks)[:, None].view(np.uint8)
    return blocks


def random_tensor(qtype: Q, megabytes: int, rng: np.random.Generator) -> np.ndarray:
    """About `megabytes` MB of random `qtype` blocks, shaped (rows, bytes per row) as GGUFFile gives them, with
    f16 fields of the size a real model's scales and minimums have."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_blocks = ROW_VALUES // block_size
    rows = max(1, megabytes * 2**20 // (row_blocks * type_size))
    f16_values = (rng.uniform(1e-4, 1e-2, 4096) * rng.choice([-1, 1], 4096)).astype(np.float16)
    return random_blocks(rng, qtype, rows * row_blocks, f16_values).reshape(rows, -1)


def seconds_per_byte(fn: Callable[[], object], n_bytes: int, total_bytes: int) -> float:
    """Seconds per byte of running `fn` (which handles `n_bytes`) until `total_bytes` have gone through; each
    result is freed before the next call, as the loader hands each tensor to torch in turn."""
    calls = max(1, round(total_bytes / n_bytes))
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
        del out
    return (time.perf_counter() - start) / (calls * n_bytes)


def measure(qtype: Q, args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    data = random_tensor(qtype, args.tensor_mb, rng)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    part = data[:max(1, data.shape[0] * args.reference_mb // args.tensor_mb)]
    start = time.perf_counter()
    theirs = gguf.quants.dequantize(part, qtype)
    reference_s = (time.perf_counter() - start) / part.nbytes
    ours = dequantize(part, qtype)
    assert ours.tobytes() == np.ascontiguousarray(theirs, dtype=np.float32).tobytes(), qtype.name
    del ours, theirs
    total = args.total_mb * 2**20
    n_values = data.size // type_size * block_size
    dequantize(data, qtype)  # warm-up: the process gets the output's pages once (a fresh VM's are slow)
    ours_s = min(seconds_per_byte(lambda: dequantize(data, qtype), data.nbytes, total) for _ in range(args.repeats))
    write_s = min(seconds_per_byte(lambda: np.empty(n_values, np.float32).fill(0), data.nbytes, total)
                  for _ in range(args.repeats))
    values_per_byte = block_size / type_size
    return {"bits_per_value": 8 / values_per_byte, "ours_s_per_gb": ours_s * GB,
            "ours_ns_per_value": ours_s / values_per_byte * 1e9, "gguf_s_per_gb": reference_s * GB,
            "write_s_per_gb": write_s * GB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated ggml type names")
    parser.add_argument("--total-mb", type=int, default=1024, help="quantised MB that ours dequantises per run")
    parser.add_argument("--tensor-mb", type=int, default=64, help="MB of quantised data per call")
    parser.add_argument("--reference-mb", type=int, default=64, help="MB that gguf's dequantiser runs on")
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours; the fastest is kept")
    args = parser.parse_args()
    types = [Q[name] for name in args.types.split(",")]
    missing = [t.name for t in types if t not in FAST_DEQUANTIZERS]
    if missing:
        parser.error(f"no fast path for {', '.join(missing)}")
    rng = np.random.default_rng(0)
    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.total_mb} MB per run of ours, "
          f"{args.reference_mb} MB for gguf, {args.tensor_mb} MB tensors")
    print("| type | bits/value | ours s/GB | ours ns/value | gguf s/GB | gguf / ours | output write alone s/GB |")
    print("|---|---|---|---|---|---|---|")
    for qtype in types:
        row = measure(qtype, args, rng)
        print(f"| {qtype.name} | {row['bits_per_value']:.2f} | {row['ours_s_per_gb']:.2f} "
              f"| {row['ours_ns_per_value']:.2f} | {row['gguf_s_per_gb']:.1f} "
              f"| {row['gguf_s_per_gb'] / row['ours_s_per_gb']:.1f}x | {row['write_s_per_gb']:.2f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
