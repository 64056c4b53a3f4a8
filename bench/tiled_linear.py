"""bf16 products on packed blocks (engine/kernels/tiled_linear.cpp) against oneDNN: decode batches and prefill chunks.

    python -m bench.tiled_linear [--rows 2,8,32,64,128] [--batches 32,64] [--prefill-rows 512,1024,2048]
                               [--prefill-prompts 16,64] [--gate-up-rows 64,512,1024,2048,4096]
                               [--gate-up-batches 64] [--rounds 5]

Part 1, products: the 121 products of one SmolLM2-135M decode step (30 layers of qkv, o, gate_up, down, then
the LM head; random weights of the real shapes, 269 MB), at each --rows, with the caches flushed by a 512 MB
write before each pass. Both packings alternate within each round; prints the median ms per pass and the
weight bytes read per second, beside a plain sum over the same weights (the read bandwidth to compare with).
Part 2, engine: two `LLM`s in this process, one packing its weights for our kernel and one for oneDNN,
generating --batches prompts of 128 tokens to 128 new tokens (greedy), alternating; prints median output
tokens/s and TPOT.
Part 3, prefill products: the 120 layer products of a forward over --prefill-rows rows (weights from memory, 30
distinct layers), F.linear on the plain weight (oneDNN's brgemm, the library path) against our kernel,
alternated; median ms, TFLOPS, speed-up.
Part 4, engine prefill: one `LLM` at the server's step budget (EngineConfig's max_num_batched_tokens),
prefilling --prefill-prompts prompts of 128 tokens (one output token), with our kernel for up to
the engine's max_tiled_rows (shipped) and for up to CpuKernelConfig.max_onednn_rows only (F.linear above),
alternated; median prompt tokens/s and the median of the paired ratios. The MLP's gate|up product takes the fused
call in both (part 6 compares that call with the two passes).
Part 5, gate|up with SiLU: the MLP's gate|up product and SiLU(gate) * up over the 30 layers' weights (from memory)
at --gate-up-rows rows, three ways alternated: the fused call (tiled_linear_silu_mul, shipped), our product then
silu_mul, F.linear then silu_mul; median ms, and each two-pass way's time over the fused one's (paired medians).
Part 6, engine gate|up: two `LLM`s, with CpuKernelConfig.fused_gate_up on and off, as part 2 at --gate-up-batches.
Our kernel runs on the CPU's first engine (cpu_ext.matrix_engines: AMX tiles, else AVX-512 BF16 vectors); it
needs one of them.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.backends import CpuKernelBackend, CpuKernelConfig
from engine.kernels import cpu_ext, packed_linear

LAYERS, HIDDEN, QKV, INTERMEDIATE, VOCAB = 30, 576, 960, 1536, 49152  # SmolLM2-135M
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def step_weights() -> list[torch.Tensor]:
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    return weights + [torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) * 0.02]


def one_pass(rows: int, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> float:
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
    start = time.perf_counter()
    for weight, pack in zip(weights, packed):
        if pack.dim() == 4:
            cpu_ext.tiled_linear(inputs[weight.shape[1]], pack)
        else:
            packed_linear.onednn_linear(inputs[weight.shape[1]], pack, None)
    return time.perf_counter() - start


def read_pass(weights: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for weight in weights:
        weight.sum()
    return time.perf_counter() - start


def products(rows_list: list[int], rounds: int) -> None:
    weights = step_weights()
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    packings = {"ours": [cpu_ext.tile_pack(w) for w in weights],
                "onednn": [packed_linear.pack_onednn(w, CpuKernelConfig().onednn_batch_hint) for w in weights]}
    flush = torch.empty(256 << 20, dtype=torch.bfloat16)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for rows in rows_list:
            for name, packed in packings.items():
                flush.fill_(1)
                times.setdefault((name, rows), []).append(one_pass(rows, weights, packed))
        flush.fill_(1)
        times.setdefault(("sum", 0), []).append(read_pass(weights))
    read_s = statistics.median(times[("sum", 0)])
    print(f"products of one decode step ({len(weights)} products, {nbytes / 1e6:.0f} MB of weights, caches flushed), "
          f"median of {rounds}; plain sum over the weights: {read_s * 1e3:.1f} ms ({nbytes / read_s / 1e9:.1f} GB/s)")
    print(f"{'rows':>5} {'oneDNN ms':>10} {'GB/s':>6} {'ours ms':>8} {'GB/s':>6} {'speed-up':>9}")
    for rows in rows_list:
        onednn, ours = (statistics.median(times[(n, rows)]) for n in ("onednn", "ours"))
        print(f"{rows:>5} {onednn * 1e3:>10.1f} {nbytes / onednn / 1e9:>6.1f} {ours * 1e3:>8.1f} "
              f"{nbytes / ours / 1e9:>6.1f} {onednn / ours:>8.2f}x")


def engine(batches: list[int], rounds: int, threads: int, switch: str = "tiled_packing",
           names: tuple[str, str] = ("ours", "onednn")) -> None:
    """Two engines alternated: CpuKernelConfig.<switch> on (names[0]) and off (names[1])."""
    from bench.offline_throughput import build_engine, parse_args
    from bench.step_budget import alternate

    engines = {}
    for name, on in zip(names, (True, False)):
        engines[name] = build_engine(parse_args(["--batch-sizes", str(max(batches)), "--threads", str(threads)]),
                                     max(batches))
        engines[name].engine.runner.set_backend(CpuKernelBackend(replace(CpuKernelConfig(), **{switch: on})))
    results = alternate(engines, batches, 128, 128, rounds)
    print(f"\nengine, 128 in / 128 out, greedy, {threads} threads, median of {rounds} alternated rounds")
    for batch in batches:
        line = []
        for name in engines:
            runs = results[(name, batch)]
            line.append(f"{name} {statistics.median(r.tokens_per_s for r in runs):6.1f} tok/s "
                        f"(TPOT p50 {statistics.median(r.tpot_p50_ms for r in runs):5.1f} ms)")
        ratios = [a.tokens_per_s / o.tokens_per_s for a, o in zip(results[(names[0], batch)], results[(names[1], batch)])]
        print(f"B={batch}: " + ", ".join(line) + f"; ratio of rounds median {statistics.median(ratios):.2f}x")


def prefill_products(rows_list: list[int], rounds: int) -> None:
    weights = step_weights()[:-1]  # the layers' products; prefill samples the LM head on a few rows only
    packed = [cpu_ext.tile_pack(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"\nprefill products ({len(weights)} per forward, weights from memory), median of {rounds} alternated")
    print(f"{'rows':>5} {'F.linear ms':>12} {'TFLOPS':>7} {'ours ms':>8} {'TFLOPS':>7} {'speed-up':>9}")
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {"F.linear": [], "ours": []}
        for _ in range(rounds):
            start = time.perf_counter()
            for weight in weights:
                F.linear(inputs[weight.shape[1]], weight)
            times["F.linear"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for weight, pack in zip(weights, packed):
                cpu_ext.tiled_linear(inputs[weight.shape[1]], pack)
            times["ours"].append(time.perf_counter() - start)
        onednn, ours = statistics.median(times["F.linear"]), statistics.median(times["ours"])
        print(f"{rows:>5} {onednn * 1e3:>12.1f} {flops_per_row * rows / onednn / 1e12:>7.2f} {ours * 1e3:>8.1f} "
              f"{flops_per_row * rows / ours / 1e12:>7.2f} {onednn / ours:>8.2f}x")


def engine_prefill(prompt_counts: list[int], rounds: int, threads: int) -> None:
    from bench.offline_throughput import PromptFactory, greedy
    from engine import LLM
    from engine.config import EngineConfig

    budget = EngineConfig().max_num_batched_tokens
    llm = LLM(num_threads=threads, max_num_seqs=max(prompt_counts), max_num_batched_tokens=budget)
    factory = PromptFactory(llm.tokenizer, 128)
    llm.generate(factory.make(2), greedy(4))  # warm-up
    shipped = llm.engine.runner.backend
    backends = {"ours to max_tiled_rows": CpuKernelBackend(replace(shipped.config, dispatch=None)),  # the limits'
                "ours to max_onednn_rows": CpuKernelBackend(replace(shipped.config, dispatch=None,
                                                                    max_tiled_rows=shipped.config.max_onednn_rows))}
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for round_index in range(rounds):
            for count in prompt_counts:
                for name in (list(backends) if round_index % 2 == 0 else list(reversed(backends))):
                    llm.engine.runner.set_backend(backends[name])  # prepares the packed copies: not timed
                    prompts = factory.make(count)  # fresh: no prefix-cache hit on the other variant's blocks
                    start = time.perf_counter()
                    llm.generate(prompts, greedy(1))
                    rates.setdefault((name, count), []).append(count * 128 / (time.perf_counter() - start))
    finally:
        llm.engine.runner.set_backend(shipped)
    print(f"\nengine prefill, {budget}-token steps, 128-token prompts, one output token, {threads} threads, "
          f"median of {rounds} alternated rounds (prompt tokens/s)")
    new, old = backends
    for count in prompt_counts:
        ratios = [a / b for a, b in zip(rates[(new, count)], rates[(old, count)])]
        print(f"{count:>3} prompts: {new} {statistics.median(rates[(new, count)]):7.1f}, {old} "
              f"{statistics.median(rates[(old, count)]):7.1f}; paired ratio median {statistics.median(ratios):.2f}x")


def gate_up_products(rows_list: list[int], rounds: int) -> None:
    weights = [torch.randn(2 * INTERMEDIATE, HIDDEN, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    fused = [packed_linear.pack_gate_up(w) for w in weights]
    plain = [cpu_ext.tile_pack(w) for w in weights]
    ways = {"fused": lambda x: [cpu_ext.tiled_linear_silu_mul(x, f) for f in fused],
            "ours, silu_mul": lambda x: [cpu_ext.silu_mul(cpu_ext.tiled_linear(x, p)) for p in plain],
            "F.linear, silu_mul": lambda x: [cpu_ext.silu_mul(F.linear(x, w)) for w in weights]}
    print(f"\ngate|up with SiLU ({LAYERS} layers' weights), ms per forward, median of {rounds} alternated rounds; "
          "(x) = time over the fused call's, paired")
    print(f"{'rows':>5} " + " ".join(f"{name:>24}" for name in ways))
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for round_index in range(rounds):
            for name in (list(ways) if round_index % 2 == 0 else list(reversed(ways))):
                start = time.perf_counter()
                ways[name](x)
                times[name].append(time.perf_counter() - start)
        cells = [f"{statistics.median(times[name]) * 1e3:>15.2f} ({statistics.median(t / f for t, f in zip(times[name], times['fused'])):.2f}x)"
                 for name in ways]
        print(f"{rows:>5} " + " ".join(f"{cell:>24}" for cell in cells))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="2,8,32,64,128", help="rows of the products pass; empty skips it")
    p.add_argument("--batches", default="32,64", help="engine batches; empty skips the engine part")
    p.add_argument("--prefill-rows", default="512,1024,2048", help="rows of the prefill products; empty skips it")
    p.add_argument("--prefill-prompts", default="16,64", help="prompts of the engine prefill part; empty skips it")
    p.add_argument("--gate-up-rows", default="64,512,1024,2048,4096",
                   help="rows of the gate|up with SiLU part; empty skips it")
    p.add_argument("--gate-up-batches", default="64", help="batches of the engine gate|up part; empty skips it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if not cpu_ext.matrix_engines():
        raise SystemExit("neither AMX nor AVX-512 BF16 here (cpu_ext.matrix_engines() is empty): nothing to compare")
    print(f"our kernel's engine: {cpu_ext.matrix_engines()[0]}")
    if a.rows:
        products([int(r) for r in a.rows.split(",")], a.rounds)
    if a.batches:
        engine([int(b) for b in a.batches.split(",")], a.rounds, a.threads)
    if a.prefill_rows:
        prefill_products([int(r) for r in a.prefill_rows.split(",")], a.rounds)
    if a.prefill_prompts:
        engine_prefill([int(n) for n in a.prefill_prompts.split(",")], a.rounds, a.threads)
    if a.gate_up_rows:
        gate_up_products([int(r) for r in a.gate_up_rows.split(",")], a.rounds)
    if a.gate_up_batches:
        engine([int(b) for b in a.gate_up_batches.split(",")], a.rounds, a.threads, "fused_gate_up",
               ("fused", "two-pass"))


if __name__ == "__main__":
    main()
