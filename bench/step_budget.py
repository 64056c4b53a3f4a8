"""Step token budget against offline throughput: one engine per --max-num-batched-tokens value, all in one
process, running the same workload in alternating rounds so that machine noise hits every budget alike.

    python -m bench.step_budget [--budgets 512,2048] [--batch 64] [--input-len 128] [--output-len 128] [--rounds 4]

Prints each round and the median output tokens/s, prefill-phase time (the last first token) and TPOT per
budget. This is where `LLM`'s default budget (engine/llm.py OFFLINE_MAX_NUM_BATCHED_TOKENS) comes from.
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

from bench.offline_throughput import OursResult, PromptFactory, build_engine, parse_args, run_ours


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
    budgets = [int(b) for b in a.budgets.split(",")]
    engines, prompts = {}, {}
    for budget in budgets:
        args = parse_args(["--batch-sizes", str(a.batch), "--input-len", str(a.input_len), "--output-len",
                           str(a.output_len), "--threads", str(a.threads), "--max-num-batched-tokens", str(budget)])
        engines[budget] = build_engine(args, a.batch)
        prompts[budget] = PromptFactory(engines[budget].tokenizer, a.input_len)  # fresh prompts: no cache hits
        run_ours(engines[budget], prompts[budget].make(4), 4)  # warm-up
    results: dict[int, list[OursResult]] = {b: [] for b in budgets}
    for round_index in range(a.rounds):
        for budget in budgets:
            r = run_ours(engines[budget], prompts[budget].make(a.batch), a.output_len)
            results[budget].append(r)
            print(f"round {round_index + 1} budget {budget:>5}: {r.tokens_per_s:7.1f} tok/s in {r.wall_s:5.2f} s, "
                  f"last first token {r.ttft_max_ms:6.0f} ms, TPOT p50 {r.tpot_p50_ms:5.1f} ms", flush=True)
    print(f"\nmedians over {a.rounds} rounds, batch {a.batch}, {a.input_len} in, {a.output_len} out, "
          f"{a.threads} threads")
    for budget, runs in results.items():
        print(f"budget {budget:>5}: {statistics.median(r.tokens_per_s for r in runs):7.1f} tok/s, last first token "
              f"{statistics.median(r.ttft_max_ms for r in runs):6.0f} ms, "
              f"TPOT p50 {statistics.median(r.tpot_p50_ms for r in runs):5.1f} ms")


if __name__ == "__main__":
    main()
