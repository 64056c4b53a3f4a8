"""Prefill attention of fresh prompts: our kernel (engine/kernels/prompt_attention.cpp) against torch's SDPA.

    python -m bench.prompt_attention [--shapes 128x16,64x32,16x128,4x512,1x2048] [--rounds 15] [--threads 2]

Each shape is COUNTxS: COUNT prompts of S tokens in one call, SmolLM2's heads (9 query, 3 kv, head_dim 64),
q/k/v as strided views of one fused qkv output as the model passes them. Each engine the CPU has (AMX tiles,
AVX-512 BF16 vectors) and SDPA alternate within each round; prints median ms per call, SDPA's time over each
engine's, and the largest difference between each engine's output and SDPA's.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from engine.kv.host_memory import keep_freed_memory
from engine.kernels import cpu_ext

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float) -> torch.Tensor:
    """What engine/backends/attention.py runs without the kernel: one batched causal SDPA call."""
    rows, heads, head_dim = q.shape
    qh, kh, vh = (x.view(count, rows // count, -1, head_dim).transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows, heads, head_dim)


def views(count: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = torch.randn(count * length, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)


def measure(count: int, length: int, rounds: int) -> None:
    q, k, v = views(count, length)
    scale = HEAD_DIM ** -0.5
    runs = {engine: functools.partial(cpu_ext.prompt_attention, engine=engine)
            for engine in cpu_ext.matrix_engines()}
    runs["sdpa"] = sdpa
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            outputs[name] = fn(q, k, v, count, scale)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    line = f"{count:5d} x {length:5d}: sdpa {ms['sdpa']:8.3f} ms"
    for engine in cpu_ext.matrix_engines():
        diff = (outputs[engine].float() - outputs["sdpa"].float()).abs().max().item()
        line += (f" | {engine} {ms[engine]:8.3f} ms, sdpa/{engine} {ms['sdpa'] / ms[engine]:5.2f}x,"
                 f" max |difference| {diff:.4f}")
    print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128x16,64x32,16x128,4x512,1x2048")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not cpu_ext.matrix_engines():
        raise SystemExit("the prompt-attention kernel needs AMX tiles or AVX-512 BF16 (and the compiled kernels)")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine runs: no page faults on each call's fresh output
    for shape in args.shapes.split(","):
        count, length = (int(x) for x in shape.split("x"))
        measure(count, length, args.rounds)


if __name__ == "__main__":
    main()
