"""`--weight-dtype auto` against bfloat16 weights on the embedded engine: decode tokens/s at each batch size.

    python -m bench.auto_vs_bf16 [--batch 1,8,32,64] [--rounds 5] [--steps 32] [--context 64] [--threads 2]
        [--dispatch measured|shipped] [--model PATH] [--omp-wait-policy default|passive|active] [--json OUT]

Two `LLM`s of the same model (the default: SmolLM2-135M's Q4_1 GGUF, whose `auto` is int4 layers), one with `auto`
weights and one with bfloat16, each on the dispatch table it measured (or read from the cache) at start
(`--dispatch shipped`: CpuKernelConfig's constants instead). For each
batch size B: B sequences of `--context` tokens of English text prefilled (untimed), then `--steps` timed decode
steps (bench.kv_accuracy.decode_rate), the two engines alternated over `--rounds` (which goes first alternates
too); the median tok/s of each and the median of the per-round ratios auto / bf16. Prints the table, the formats
`auto` chose, and each engine's dispatch table.

OpenMP's wait policy is libgomp's own by default (spin briefly, then sleep), as the actors run it
(actors/spec.py `child_environment`) and as an embedded `LLM` gets it; `passive` puts a futex wake-up behind each
parallel region of a step, a fixed cost of some 20 us each that weighs most at batch 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

WAIT_POLICIES = ("default", "passive", "active")


def add_wait_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--omp-wait-policy", choices=WAIT_POLICIES, default="default",
                   help="OpenMP's wait policy (default: libgomp's own, as the actors run)")


def set_wait_policy(argv: list[str]) -> None:
    """OMP_WAIT_POLICY from --omp-wait-policy: read before torch loads OpenMP, which reads it once."""
    pre = argparse.ArgumentParser(add_help=False)
    add_wait_policy(pre)
    policy = pre.parse_known_args(argv)[0].omp_wait_policy
    if policy != "default":
        os.environ["OMP_WAIT_POLICY"] = policy.upper()


if __name__ == "__main__":
    set_wait_policy(sys.argv[1:])

import torch  # noqa: E402

from bench.kv_accuracy import corpus_windows, decode_rate  # noqa: E402
from engine import LLM  # noqa: E402

WEIGHTS = {"bf16": "bfloat16", "auto": "auto"}


def build(args: argparse.Namespace, weights: str, batch: int) -> LLM:
    blocks = batch * -(-(args.context + args.steps + 8) // 16) + 16
    return LLM(args.model, dtype="bfloat16", weight_dtype=weights, num_kv_blocks=blocks, num_threads=args.threads,
               max_num_seqs=batch, kernel_dispatch=args.dispatch)


def rates(llms: dict[str, LLM], prompts: list[list[int]], steps: int, rounds: int) -> dict[str, dict]:
    """Each engine's tok/s over `rounds` alternated runs (the first to run alternates), medians and ratios."""
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for r in range(rounds):
        order = list(llms) if r % 2 == 0 else list(llms)[::-1]
        for name in order:
            runs[name].append(decode_rate(llms[name], prompts, steps))
    ratios = [a / b for a, b in zip(runs["auto"], runs["bf16"])]
    return {"bf16": statistics.median(runs["bf16"]), "auto": statistics.median(runs["auto"]),
            "ratio": statistics.median(ratios), "runs": runs}


def describe(llm: LLM) -> dict:
    backend = llm.engine.runner.backend
    out = {"backend": backend.name}
    if hasattr(backend, "dispatch"):
        out["dispatch"] = backend.dispatch.describe()
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32,64", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dispatch", default="measured", choices=("measured", "shipped"))
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    add_wait_policy(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    most = max(batches)
    llms = {name: build(args, weights, most) for name, weights in WEIGHTS.items()}
    windows = corpus_windows(llms["bf16"].tokenizer, args.context, 16)
    results = {"engines": {name: describe(llm) for name, llm in llms.items()}, "speed": {}}
    print(f"{torch.get_num_threads()} threads, {args.dispatch} dispatch; {args.context} tokens of context, {args.steps} timed decode steps, "
          f"{args.rounds} rounds alternated; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}\n")
    print(f"{'batch':>5} {'bf16 tok/s':>11} {'auto tok/s':>11} {'auto / bf16':>12}  (medians; ratio: of rounds)")
    for batch in batches:
        prompts = [windows[i % len(windows)] for i in range(batch)]
        r = rates(llms, prompts, args.steps, args.rounds)
        results["speed"][batch] = r
        print(f"{batch:>5} {r['bf16']:>11.1f} {r['auto']:>11.1f} {r['ratio']:>12.2f}", flush=True)
    for name, info in results["engines"].items():
        print(f"\n{name} weights ({info['backend']}), dispatch table:")
        for fmt, route in info.get("dispatch", {}).items():
            print(f"  {fmt:<7} {route}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
