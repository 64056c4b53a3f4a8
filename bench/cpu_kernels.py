"""Where the CPU kernels pay: one decode forward of the served model (bf16) at several batch sizes and context
lengths, with plain torch ops, with each kind alone (engine/kernels/cpu_ext's GEMV, in-place decode attention
and fused elementwise ops; engine/kernels/packed_linear's oneDNN-packed weights), with all of them from the
Python layers ("layers") and with all of them as an engine runs them (the decode stack, one C++ call for the
layers), interleaved so that machine noise hits all variants alike.

    python -m bench.cpu_kernels [--batches 1,2,4,8,16,32,64] [--contexts 192,1024] [--repeats 12]

Prints min and median milliseconds per forward (logits included), and the median of the paired ratios
layers / all (what the decode stack gains over the Python layer loop on the same kernels). The limits of CpuKernelConfig (max_gemv_rows,
max_attention_seqs, fused_elementwise, max_onednn_rows / max_tiled_rows) come from this table: each kind is forced
on in its own column; "all" is what an engine runs (every kind within its shipped limits).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from engine.backends.attention import AttentionMetadata
from engine.backends import CpuKernelBackend, CpuKernelConfig
from engine.kv.cache import KVCache
from engine.model.loader import load_model, resolve_model

BLOCK = 16


def forward_ms(model, kv: KVCache, tables: list[list[int]], ctx: int, kernels: bool) -> float:
    batch = len(tables)
    meta = AttentionMetadata.build(BLOCK, [(t, ctx) for t in tables], [], kernels)
    ids, pos = torch.randint(0, 40000, (batch,)), torch.full((batch,), ctx - 1)
    start = time.perf_counter()
    with torch.inference_mode():
        model.compute_logits(model(ids, pos, meta, kv.layers))
    return (time.perf_counter() - start) * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--contexts", default="192,1024")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    source = resolve_model(a.model)
    forced, shipped = 1 << 30, CpuKernelConfig()
    off = CpuKernelConfig(max_gemv_rows=0, max_onednn_rows=0, max_tiled_rows=0, fused_elementwise=False,
                          decode_stack=False)
    # name: (kernel config or None for torch ops, attention kernel); "layers" and "all" keep the shipped limits
    variants = {"torch ops": (None, False),
                "gemv": (replace(off, max_gemv_rows=forced), False),
                "packed": (replace(off, max_onednn_rows=forced, max_tiled_rows=forced), False),
                "attention": (replace(off, max_attention_seqs=forced), True),
                "elementwise": (replace(off, fused_elementwise=True), False),
                "layers": (replace(shipped, decode_stack=False), True),
                "all": (shipped, True)}
    models = {}
    for name, (config, _) in variants.items():
        models[name] = load_model(source, torch.bfloat16)
        if config is not None:
            models[name].set_backend(CpuKernelBackend(config))
    print(f"torch threads {torch.get_num_threads()}; ms per decode forward (min / median of {a.repeats})")
    print(f"{'batch':>5} {'ctx':>5}  " + "  ".join(f"{name:>15}" for name in variants) + f"  {'layers/all':>10}")
    for ctx in (int(x) for x in a.contexts.split(",")):
        for batch in (int(x) for x in a.batches.split(",")):
            nb = ctx // BLOCK + 1
            kv = KVCache(source.config, batch * nb + 1, BLOCK, torch.bfloat16)
            kv.data.normal_()
            tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(a.repeats):
                for name, (_, attention) in variants.items():
                    times[name].append(forward_ms(models[name], kv, tables, ctx, attention))
            cells = [f"{min(t):6.1f} / {statistics.median(t):6.1f}" for t in times.values()]
            stack_gain = statistics.median(a / b for a, b in zip(times["layers"], times["all"]))
            print(f"{batch:>5} {ctx:>5}  " + "  ".join(f"{c:>15}" for c in cells) + f"  {stack_gain:>10.2f}x",
                  flush=True)

if __name__ == "__main__":
    main()
