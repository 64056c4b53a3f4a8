"""Two commits side by side: greedy outputs and offline throughput, each commit in its own checkout.

    python -m bench.compare_commits BASE [HEAD] [--prompts 16] [--max-tokens 64] [--bench-rounds 0]

Checks out each commit (git worktree, detached, under a temporary folder) and runs, in a fresh interpreter
per commit with its own kernel build cache, `LLM(dtype=D).generate(prompts, greedy)` on the default model
for D in float32 and bfloat16; then prints, per dtype, on how many prompts the token ids differ and where
the first difference is. Only `from engine import LLM, SamplingParams` is used, so any two commits with that
API compare. With --bench-rounds N it also runs `python -m bench.offline_throughput --skip-hf` in the two
checkouts alternately, N times each, and prints the median output tokens/s per batch size and the median of
the per-round ratios HEAD / BASE.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):", "The three laws of thermodynamics state that",
    "Write a haiku about autumn leaves.", "In 1969, the first humans landed on",
    "A recipe for pancakes needs", "The quick brown fox jumps over",
    "Photosynthesis is the process by which", "SELECT name, age FROM users WHERE",
    "The best way to learn a new language is", "Dear hiring manager, I am writing to apply for",
    "1, 1, 2, 3, 5, 8, 13,", "The mitochondria is the powerhouse of", "To be or not to be,",
    "An API is a set of rules that",
]

RUNNER = """
import json, sys
from engine import LLM, SamplingParams
prompts, max_tokens, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
result = {}
for dtype in ("float32", "bfloat16"):
    llm = LLM(dtype=dtype)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    result[dtype] = [o.token_ids for o in outs]
    del llm
open(out, "w").write(json.dumps(result))
"""


def checkout(repo: Path, commit: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(into), commit], check=True)
    return into


def commit_sha(repo: Path, commit: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", commit], check=True, capture_output=True,
                          text=True).stdout.strip()


def run_env(tree: Path, cache: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(cache))
    env.pop("PYTHONSTARTUP", None)
    return env


def greedy_outputs(tree: Path, cache: Path, prompts: list[str], max_tokens: int) -> dict[str, list[list[int]]]:
    out = cache / "outputs.json"
    subprocess.run([sys.executable, "-c", RUNNER, json.dumps(prompts), str(max_tokens), str(out)],
                   cwd=tree, env=run_env(tree, cache), check=True)
    return json.loads(out.read_text())


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def report_outputs(base: dict, head: dict) -> None:
    for dtype in base:
        diffs = [(i, first_difference(a, b)) for i, (a, b) in enumerate(zip(base[dtype], head[dtype]))]
        changed = [(i, at) for i, at in diffs if at is not None]
        where = ", ".join(f"prompt {i} from token {at}" for i, at in changed) or "none"
        print(f"{dtype}: {len(changed)} of {len(diffs)} greedy outputs differ ({where})")


def throughput(tree: Path, cache: Path, batch_sizes: str) -> dict[int, float]:
    out = cache / "bench.json"
    subprocess.run([sys.executable, "-m", "bench.offline_throughput", "--skip-hf", "--batch-sizes", batch_sizes,
                    "--json", str(out)], cwd=tree, env=run_env(tree, cache), check=True,
                   stdout=subprocess.DEVNULL)
    return {r["batch"]: r["tokens_per_s"] for r in json.loads(out.read_text())["ours"]}


def report_throughput(base_runs: list[dict], head_runs: list[dict]) -> None:
    print("batch  base tok/s  head tok/s  head/base (median of rounds)")
    for batch in base_runs[0]:
        b = [r[batch] for r in base_runs]
        h = [r[batch] for r in head_runs]
        ratios = [y / x for x, y in zip(b, h)]
        print(f"{batch:>5}  {statistics.median(b):>10.1f}  {statistics.median(h):>10.1f}  "
              f"{statistics.median(ratios):.3f} ({' / '.join(f'{r:.3f}' for r in ratios)})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("head", nargs="?", default="HEAD")
    p.add_argument("--prompts", type=int, default=16, help="how many of the built-in prompts (at most 16)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bench-rounds", type=int, default=0, help="offline_throughput runs per commit, alternated")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--cache", default=None, help="keep each commit's checkout and kernel build under CACHE "
                   "(default: a temporary folder, built afresh)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="compare-commits-") as tmp:
        root = Path(args.cache) if args.cache else Path(tmp)
        shas = {"base": commit_sha(repo, args.base), "head": commit_sha(repo, args.head)}
        trees = {name: kept_checkout(repo, sha, root / "trees" / sha) for name, sha in shas.items()}
        caches = {name: root / "kernels" / sha for name, sha in shas.items()}
        try:
            for cache in caches.values():
                cache.mkdir(parents=True, exist_ok=True)
            outs = {n: greedy_outputs(trees[n], caches[n], PROMPTS[:args.prompts], args.max_tokens) for n in trees}
            print(f"greedy, {args.max_tokens} tokens, EOS ignored, {args.prompts} prompts in one batch: "
                  f"{args.base} ({shas['base'][:7]}) against {args.head} ({shas['head'][:7]})")
            report_outputs(outs["base"], outs["head"])
            runs: dict[str, list[dict]] = {"base": [], "head": []}
            for _ in range(args.bench_rounds):
                for name in trees:
                    runs[name].append(throughput(trees[name], caches[name], args.batch_sizes))
            if args.bench_rounds:
                report_throughput(runs["base"], runs["head"])
        finally:
            if not args.cache:
                for tree in set(trees.values()):
                    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)


def kept_checkout(repo: Path, sha: str, path: Path) -> Path:
    """A checkout of `sha` at `path`, reused when it is already there: the kernel build is keyed by the source
    paths and their times, so a kept checkout keeps its build."""
    return path if path.exists() else checkout(repo, sha, path)


if __name__ == "__main__":
    main()
