"""Step token budget against offline throughput: one engine per --max-num-batched-tokens value, all in one
process, running the same workload in alternating rounds so that machine noise hits every budget alike.

    python -m bench.step_budget [--budgets 512,2048] [--batch 64] [--input-len 128] [--output-len 128] [--rounds 4]

Prints each round and the median output tokens/s, prefill-phase time (the last first token) and TPOT per
budget. This is where `LLM`'s default budget (the offline profile, engine/config.py OFFLINE) comes from.
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

from bench.offline_throughput import OursResult, PromptFactory, build_engine, parse_args, run_ours
from engine import LLM


def alternate(engines: dict[str, LLM], batches: list[int], input_len: int, output_len: int,
              rounds: int) -> dict[tuple[str, int], list[OursResult]]:
    """Warm each engine up, then run each batch on every engine in turn, `rounds` times, with fresh prompts for
    every run (no prefix-cache hits); prints each run. -> runs by (engine name, batch)."""
    prompts = {name: PromptFactory(llm.tokenizer, input_len) for name, llm in engines.items()}
    for name, llm in engines.items():
        run_ours(llm, prompts[name].make(4), 4)
    results: dict[tuple[str, int], list[OursResult]] = {}
    for round_index in range(rounds):
        for batch in batches:
            for name, llm in engines.items():
                r = run_ours(llm, prompts[name].make(batch), output_len)
                results.setdefault((name, batch), []).append(r)
                print(f"round {round_index + 1} B={batch} {name}: {r.tokens_per_s:7.1f} tok/s in {r.wall_s:5.2f} s, "
                      f"last first token {r.ttft_max_ms:6.0f} ms, TPOT p50 {r.tpot_p50_ms:5.1f} ms", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", default="512,2048")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engines = {}
    for budget in a.budgets.split(","):
        args = parse_args(["--batch-sizes", str(a.batch), "--input-len", str(a.input_len), "--output-len",
                           str(a.output_len), "--threads", str(a.threads), "--max-num-batched-tokens", budget])
        engines[f"budget {int(budget):>5}"] = build_engine(args, a.batch)
    results = alternate(engines, [a.batch], a.input_len, a.output_len, a.rounds)
    print(f"\nmedians over {a.rounds} rounds, batch {a.batch}, {a.input_len} in, {a.output_len} out, "
          f"{a.threads} threads")
    for name in engines:
        runs = results[(name, a.batch)]
        print(f"{name}: {statistics.median(r.tokens_per_s for r in runs):7.1f} tok/s, last first token "
              f"{statistics.median(r.ttft_max_ms for r in runs):6.0f} ms, "
              f"TPOT p50 {statistics.median(r.tpot_p50_ms for r in runs):5.1f} ms")


if __name__ == "__main__":
    main()
