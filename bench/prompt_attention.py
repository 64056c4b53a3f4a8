"""Prefill attention of fresh prompts: our AMX kernel (engine/kernels/amx_attention.cpp) against torch's SDPA.

    python -m bench.prompt_attention [--shapes 128x16,64x32,16x128,4x512,1x2048] [--rounds 15] [--threads 2]

Each shape is COUNTxS: COUNT prompts of S tokens in one call, SmolLM2's heads (9 query, 3 kv, head_dim 64),
q/k/v as strided views of one fused qkv output as the model passes them. The two alternate within each round;
prints median ms per call, the ratio, and the largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.host_memory import keep_freed_memory
from engine.kernels import cpu_ext

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float) -> torch.Tensor:
    """What engine/attention.py runs without the kernel: one batched causal SDPA call."""
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
    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    outputs = {}
    for _ in range(rounds):
        for name, fn in (("kernel", cpu_ext.prompt_attention), ("sdpa", sdpa)):
            start = time.perf_counter()
            outputs[name] = fn(q, k, v, count, scale)
            times[name].append(time.perf_counter() - start)
    kernel, torch_ms = (statistics.median(times[n]) * 1e3 for n in ("kernel", "sdpa"))
    diff = (outputs["kernel"].float() - outputs["sdpa"].float()).abs().max().item()
    print(f"{count:5d} x {length:5d}: kernel {kernel:8.3f} ms  sdpa {torch_ms:8.3f} ms  "
          f"sdpa/kernel {torch_ms / kernel:5.2f}x  max |difference| {diff:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128x16,64x32,16x128,4x512,1x2048")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not cpu_ext.amx_available():
        raise SystemExit("the prompt-attention kernel needs a CPU with AMX tiles (and the compiled kernels)")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine runs: no page faults on each call's fresh output
    for shape in args.shapes.split(","):
        count, length = (int(x) for x in shape.split("x"))
        measure(count, length, args.rounds)


if __name__ == "__main__":
    main()
