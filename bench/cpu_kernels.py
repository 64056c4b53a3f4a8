"""Where the CPU kernels pay: one decode forward of the served model (bf16) at several batch sizes and context
lengths, with plain torch ops, with each kind alone (engine/kernels/cpu_ext's GEMV, in-place decode attention
and fused elementwise ops; engine/kernels/packed_linear's oneDNN-packed weights), with all of them from the
Python layers ("layers") and with all of them as an engine runs them (the decode stack, one C++ call for the
layers), interleaved so that machine noise hits all variants alike.

    python -m bench.cpu_kernels [--batches 1,2,4,8,16,32,64] [--contexts 192,1024] [--repeats 12]

Prints min and median milliseconds per forward (logits included). The limits (cpu_ext.MAX_GEMV_ROWS,
MAX_ATTENTION_SEQS, FUSED_ELEMENTWISE, packed_linear.MAX_PACKED_ROWS / MAX_TILED_ROWS) come from this table: each
kind is forced on in its own column; "all" is what an engine runs (every kind within its shipped limits).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.kernels import cpu_ext, packed_linear
from engine.kv_cache import KVCache
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
    assert cpu_ext.available(), "the CPU kernels could not be built"
    source = resolve_model(a.model)
    eager, fast = load_model(source, torch.bfloat16), load_model(source, torch.bfloat16)
    fast.use_kernels(True)
    saved = (cpu_ext.MAX_GEMV_ROWS, cpu_ext.MAX_ATTENTION_SEQS, cpu_ext.FUSED_ELEMENTWISE, cpu_ext.DECODE_STACK,
             packed_linear.MAX_PACKED_ROWS, packed_linear.MAX_TILED_ROWS)
    cpu_ext.MAX_ATTENTION_SEQS = 1 << 30  # forced on: this table decides the limits
    forced, shipped_gemv = 1 << 30, cpu_ext.MAX_GEMV_ROWS
    # packed-weight row limits: (oneDNN's copy, packed blocks)
    no_packed, all_packed = (0, 0), (forced, forced)
    shipped_packed = (packed_linear.MAX_PACKED_ROWS, packed_linear.MAX_TILED_ROWS)
    # name: (model, GEMV row limit, packed-weight row limits, attention kernel, elementwise kernels, decode stack);
    # "layers" and "all" keep the shipped limits
    variants = {"torch ops": (eager, 0, no_packed, False, False, False),
                "gemv": (fast, forced, no_packed, False, False, False),
                "packed": (fast, 0, all_packed, False, False, False),
                "attention": (fast, 0, no_packed, True, False, False),
                "elementwise": (fast, 0, no_packed, False, True, False),
                "layers": (fast, shipped_gemv, shipped_packed, True, True, False),
                "all": (fast, shipped_gemv, shipped_packed, True, True, True)}
    print(f"torch threads {torch.get_num_threads()}; ms per decode forward (min / median of {a.repeats})")
    print(f"{'batch':>5} {'ctx':>5}  " + "  ".join(f"{name:>15}" for name in variants))
    try:
        for ctx in (int(x) for x in a.contexts.split(",")):
            for batch in (int(x) for x in a.batches.split(",")):
                nb = ctx // BLOCK + 1
                kv = KVCache(source.config, batch * nb + 1, BLOCK, torch.bfloat16)
                kv.data.normal_()
                tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
                times: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(a.repeats):
                    for name, (model, gemv_rows, packed_rows, attention, elementwise, stack) in variants.items():
                        cpu_ext.MAX_GEMV_ROWS, cpu_ext.FUSED_ELEMENTWISE = gemv_rows, elementwise
                        cpu_ext.DECODE_STACK = stack
                        packed_linear.MAX_PACKED_ROWS, packed_linear.MAX_TILED_ROWS = packed_rows
                        times[name].append(forward_ms(model, kv, tables, ctx, attention))
                cells = [f"{min(t):6.1f} / {statistics.median(t):6.1f}" for t in times.values()]
                print(f"{batch:>5} {ctx:>5}  " + "  ".join(f"{c:>15}" for c in cells), flush=True)
    finally:
        (cpu_ext.MAX_GEMV_ROWS, cpu_ext.MAX_ATTENTION_SEQS, cpu_ext.FUSED_ELEMENTWISE, cpu_ext.DECODE_STACK,
         packed_linear.MAX_PACKED_ROWS, packed_linear.MAX_TILED_ROWS) = saved


if __name__ == "__main__":
    main()
