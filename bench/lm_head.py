"""The default model's LM head as `auto` and bfloat16 weights hold it, kernel by kernel: ms per product by rows.

    python -m bench.lm_head [--rows 1,2,4,8,16,32,64] [--repeats 15] [--threads 2] [--model PATH] [--json OUT]

Loads the model with `--weight-dtype auto` (the default GGUF's Q8_0 head as int8g: int8 codes in 16-channel blocks,
fp32 scales per 32, as Q8_0 holds them) and with bfloat16 weights (the head packed in 16x16-pair blocks), then times
on random bf16 rows, each kernel a dispatch table may name for a greedy step's head: int8g (the codes widened in
registers, fp32 FMAs), int8g_bf16 with torch's max of its fp32 logits after it, int8g_bf16_argmax (the pick as the
sums come out), and bf16's argmax on the packed blocks (its GEMV at one row). Prints the median ms of `--repeats` rounds
(the kernels alternated in each), and the head's bytes in each format.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: the cores are shared

import torch  # noqa: E402

from engine import LLM  # noqa: E402
from engine.backends.weight_ops import is_int8g  # noqa: E402
from engine.kernels import cpu_ext  # noqa: E402


def head_of(model: str | None, weights: str, threads: int):
    llm = LLM(model, dtype="bfloat16", weight_dtype=weights, num_kv_blocks=16, num_threads=threads, max_num_seqs=1)
    return llm.engine.runner.model.prepared.head


def median_ms(calls: dict, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Each call's median ms on x over `repeats` rounds, the calls alternated within each round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call(x)
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def kernels(auto, bf16) -> dict:
    """name -> (rows -> a call of the kernel on x of that many rows), the rows it serves."""
    def int8g_then_max(x):
        return cpu_ext.linear_int8g_bf16(x, auto.data, auto.scale, None, True).max(dim=1).indices

    def bf16_pick(x):
        if x.shape[0] == 1:
            return cpu_ext.linear_bf16(x, bf16.data, None, True).max(dim=1).indices
        return cpu_ext.tiled_linear_argmax(x, bf16.packed)
    return {"int8g": lambda x: cpu_ext.linear_int8g(x, auto.data, auto.scale, None, True),
            "int8g_bf16 + max": int8g_then_max,
            "int8g_bf16_argmax": lambda x: cpu_ext.linear_int8g_bf16_argmax(x, auto.data, auto.scale),
            "bf16 argmax": bf16_pick}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF whose auto head is int8g (default: the default model)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    auto, bf16 = head_of(args.model, "auto", args.threads), head_of(args.model, "bfloat16", args.threads)
    torch.set_num_threads(args.threads)
    if not is_int8g(auto.data, auto.scale):
        raise SystemExit("this model's auto head is not int8g: nothing to compare")
    k = bf16.data.shape[1]
    calls = kernels(auto, bf16)
    sizes = {"int8g": auto.data.numel() + auto.scale.numel() * 4, "bf16": bf16.data.numel() * 2}
    print(f"LM head {tuple(bf16.data.shape)}: int8g {sizes['int8g'] / 1e6:.1f} MB, bf16 {sizes['bf16'] / 1e6:.1f} MB; "
          f"{torch.get_num_threads()} threads, median of {args.repeats} rounds, ms\n")
    print(f"{'rows':>5} " + " ".join(f"{name:>18}" for name in calls))
    results = {"sizes": sizes, "ms": {}}
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        row = median_ms(calls, x, args.repeats)
        results["ms"][rows] = row
        print(f"{rows:>5} " + " ".join(f"{ms:>18.2f}" for ms in row.values()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
