"""Accuracy and cost of quantised KV pages (--kv-cache-dtype fp8 / fp4) on the default model.

    python -m bench.kv_accuracy [--formats fp8,fp4,adaptive] [--compress-after 128] [--windows 23] [--window 512]
        [--modes decode,pages] [--diagnostics fp8:K,fp8:V] [--chat-tokens 64] [--decode-batch 32] [--decode-context 512]
        [--decode-steps 32] [--rounds 2] [--budget-mib 256] [--seq-len 4096] [--threads 2] [--model PATH] [--json OUT] [--skip ...]

1. Teacher-forced accuracy on English text this model did not write (the license texts Debian ships in
   /usr/share/common-licenses): the text is tokenised and cut into windows; every window runs through the
   model with its KV written into a pool of the format under test, and each position's next-token
   distribution is compared with the same run on a bf16 pool (the serving dtype): KL(bf16 || quantised)
   mean and p99, top-1 agreement, and perplexity of the real next token. Two write patterns:
   `decode` feeds one token per step (every page is re-quantised as it fills, as in decoding; the scales are
   powers of two so that this does not round earlier tokens twice); `pages` feeds page-aligned chunks of 4 blocks (each page is quantised
   once, then read back by its own chunk and later ones). Positions below one chunk are left out of both
   (the first chunk of a `pages` window attends to its fresh keys, not to the cache). Diagnostic rows
   (`pages` mode) quantise only the keys or only the values.
   `adaptive` (--kv-compress fp4) keeps the newest `--compress-after` tokens of each window in bf16 (in fp8 for
   `adaptive-fp8`) and, after every step, compresses each older full page to FP4 through the engine's own
   cold region: the steady state of a pool that always runs short, so the error is an upper bound.
2. Greedy agreement on chat prompts: how many generated tokens stay identical to the bf16 pool.
3. Decode tokens/s with `--decode-batch` sequences running, each with `--decode-context` tokens of text
   before it (timed steps only, after every prompt is prefilled; formats interleaved over `--rounds`).
4. Capacity: how many `--seq-len`-token sequences fit in a `--budget-mib` pool, from the block count the
   engine itself chooses (`choose_num_blocks`; `split_kv_budget` for adaptive: the newest `--compress-after`
   tokens plus one partial page hot, the rest FP4; at the default share and at the share that balances both).
Sections 2 and 3 run the engine's page formats only (adaptive compression acts only when a pool runs short).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

if __name__ == "__main__":  # run as a bench, before torch starts OpenMP: the cores are shared
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.backends.attention import AttentionMetadata  # noqa: E402
from engine.core.engine_core import EngineCore, EngineRequest  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv.cache import KVCache, bytes_per_block, choose_num_blocks  # noqa: E402
from engine.kv.compress import COLD_FORMAT, ColdRegion, split_kv_budget  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "Apache-2.0", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "Artistic")
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
    "Suggest a name for a friendly robot and explain why.",
    "How does a refrigerator keep food cold?",
    "List four ways to save water at home.",
    "Why do cats purr?",
    "Describe a sunrise over the ocean.",
    "What should I pack for a weekend camping trip?",
    "Explain what a prime number is to a child.",
    "Write a thank-you note to a teacher.",
    "What are the benefits of regular exercise?",
)
BLOCK_SIZE = 16
PAGES_CHUNK = 4 * BLOCK_SIZE  # `pages` mode: page-aligned chunks, so each page is quantised exactly once


# ------------------------------------------------------------------------------------------ text windows

def corpus_windows(tokenizer, window: int, count: int) -> list[list[int]]:
    """`count` windows of `window` tokens, cut from the license texts one after another."""
    ids: list[int] = []
    for name in TEXTS:
        ids += tokenizer.encode((LICENSES / name).read_text(encoding="utf-8", errors="replace"))
    if len(ids) < window * count:
        raise SystemExit(f"the license texts hold {len(ids)} tokens, fewer than {count} windows of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(count)]


# ------------------------------------------------------------------------------------------ teacher forcing

def pool_layers(cfg, num_blocks: int, dtype: torch.dtype, variant: str) -> list[tuple]:
    """Per-layer (keys, values) pages for `variant`: a kv format, or `fp8:K` / `fp8:V` for a diagnostic
    pool where only the keys (values) are quantised and the other half stays in the serving dtype."""
    kv_format, _, only = variant.partition(":")
    quantised = KVCache(cfg, num_blocks, BLOCK_SIZE, dtype, kv_format=kv_format).layers
    if not only:
        return quantised
    full = KVCache(cfg, num_blocks, BLOCK_SIZE, dtype).layers
    return [(q[0] if only == "K" else f[0], q[1] if only == "V" else f[1]) for q, f in zip(quantised, full)]


class AdaptivePool:
    """Hot pages (bf16 or fp8) over the engine's FP4 cold region, with cold id = hot id + num_blocks."""

    def __init__(self, cfg, num_blocks: int, dtype: torch.dtype, hot_format: str, keep: int) -> None:
        self.hot = KVCache(cfg, num_blocks, BLOCK_SIZE, dtype, kv_format=hot_format)
        self.cold = ColdRegion(cfg, num_blocks, num_blocks, BLOCK_SIZE, dtype)
        self.layers = self.cold.layers_over(self.hot)
        self.keep = keep

    def compress_old(self, tables: list[list[int]], length: int) -> None:
        """Move every still-hot full page older than the newest `keep` of `length` cached tokens (in place)."""
        moves = []
        for table in tables:
            for i, block in enumerate(table[: max(0, length - self.keep) // BLOCK_SIZE]):
                if block < self.hot.num_blocks:
                    moves.append((block, block + self.hot.num_blocks))
                    table[i] = block + self.hot.num_blocks
        if moves:
            self.cold.compress(self.hot, moves)


def adaptive_pool(cfg, num_blocks: int, dtype: torch.dtype, variant: str, keep: int) -> AdaptivePool | None:
    """`adaptive` (bf16 hot pages) or `adaptive-fp8`; None for any other variant."""
    if not variant.startswith("adaptive"):
        return None
    return AdaptivePool(cfg, num_blocks, dtype, "fp8" if variant == "adaptive-fp8" else "auto", keep)


def forced_steps(model: LlamaModel, windows: list[list[int]], kv_format: str, chunk: int,
                 dtype: torch.dtype, keep: int) -> Iterator[torch.Tensor]:
    """Feed every window `chunk` tokens per step through a pool of `kv_format`; yield each step's logits
    [W * chunk, V] (window-major). chunk 1 runs as decode rows, larger chunks as prefill segments."""
    num_windows, length = len(windows), len(windows[0])
    per_window = -(-length // BLOCK_SIZE)
    adaptive = adaptive_pool(model.cfg, num_windows * per_window, dtype, kv_format, keep)
    layers = adaptive.layers if adaptive else pool_layers(model.cfg, num_windows * per_window, dtype, kv_format)
    tables = [list(range(i * per_window, (i + 1) * per_window)) for i in range(num_windows)]
    for start in range(0, length, chunk):
        ids = [t for w in windows for t in w[start:start + chunk]]
        positions = torch.arange(start, start + chunk).repeat(num_windows)
        if chunk == 1 and start > 0:
            meta = AttentionMetadata.build(BLOCK_SIZE, [(t, start + 1) for t in tables], [])
        else:
            meta = AttentionMetadata.build(BLOCK_SIZE, [], [(t, start, chunk) for t in tables])
        hidden = model(torch.tensor(ids), positions, meta, layers)
        if adaptive:
            adaptive.compress_old(tables, start + chunk)
        yield model.compute_logits(hidden)


@dataclass
class Scores:
    kl: list[float] = field(default_factory=list)  # per scored position
    top1: int = 0
    nll: float = 0.0
    count: int = 0

    def add(self, ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        # Python floats, not small tensors: thousands of those kept between the large logits buffers
        # fragment glibc's heap (measured: RSS grew by ~4 MB a step)
        self.kl += (ref_logp.exp() * (ref_logp - logp)).sum(-1).tolist()
        self.top1 += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        self.nll -= float(logp.gather(-1, targets[:, None]).sum())
        self.count += len(targets)

    def summary(self) -> dict:
        kl = torch.tensor(self.kl, dtype=torch.float64)
        return {"tokens": self.count, "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
                "kl_max": kl.max().item(), "top1": self.top1 / self.count, "ppl": math.exp(self.nll / self.count)}


@torch.inference_mode()  # here, around every step of the lockstep generators: a `with` inside them would
# nest out of order, and without it the in-place cache writes would chain every step's autograd graph
def teacher_forced(model: LlamaModel, windows: list[list[int]], variants: list[str], chunk: int,
                   dtype: torch.dtype, keep: int) -> dict[str, dict]:
    """Run the bf16 reference and every variant in lockstep; score positions >= PAGES_CHUNK."""
    runs = {f: forced_steps(model, windows, f, chunk, dtype, keep) for f in ["auto", *variants]}
    scores = {f: Scores() for f in runs}
    length = len(windows[0])
    for start in range(0, length, chunk):
        logits = {f: next(run) for f, run in runs.items()}  # [W * chunk, V] each
        pos = torch.arange(start, start + chunk).repeat(len(windows))
        rows = (pos >= PAGES_CHUNK) & (pos < length - 1)
        if not rows.any():
            continue
        src = torch.arange(len(windows)).repeat_interleave(chunk)[rows]
        targets = torch.tensor([windows[w][p + 1] for w, p in zip(src.tolist(), pos[rows].tolist())])
        ref = logits["auto"][rows].log_softmax(-1)
        for f in runs:
            scores[f].add(ref, logits[f][rows].log_softmax(-1), targets)
    return {f: s.summary() for f, s in scores.items()}


# ------------------------------------------------------------------------------------------ chat, speed, size

def agreement_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def chat_agreement(model: str | None, formats: list[str], max_tokens: int, threads: int) -> dict[str, dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    outs = {f: [o.token_ids for o in LLM(model, num_kv_blocks=512, kv_cache_dtype=f, num_threads=threads)
                .chat(messages, params)] for f in ["auto", *formats]}
    result = {}
    for f in formats:
        lengths = [agreement_length(a, b) for a, b in zip(outs["auto"], outs[f])]
        result[f] = {"lengths": lengths, "identical_16": sum(n >= 16 for n in lengths),
                     "identical_all": sum(n == max_tokens for n in lengths), "mean": statistics.mean(lengths)}
    return result


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens/s of one batch: prompts prefilled first (untimed), then `steps` timed decode steps."""
    engine: EngineCore = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"speed-{time.monotonic_ns()}-{i}", prompt, params))
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_all()
    return steps * len(prompts) / elapsed


def decode_speed(model: str | None, formats: list[str], windows: list[list[int]], batch: int, context: int,
                 steps: int, rounds: int, threads: int) -> dict[str, dict]:
    prompts = [w[:context] for w in (windows * batch)[:batch]]
    blocks = batch * (-(-(context + steps + 8) // BLOCK_SIZE)) + 8
    # prefix caching on: later rounds find the prompts cached and skip their (untimed) prefill
    llms = {f: LLM(model, num_kv_blocks=blocks * 2, kv_cache_dtype=f, num_threads=threads, max_num_seqs=batch,
                   max_num_batched_tokens=2048) for f in ["auto", *formats]}
    rates: dict[str, list[float]] = {f: [] for f in llms}
    for _ in range(rounds):
        for f, llm in llms.items():
            rates[f].append(decode_rate(llm, prompts, steps))
    return {f: {"tok_s": statistics.median(r), "all": r} for f, r in rates.items()}


def capacity(cfg, formats: list[str], budget: int, seq_len: int, keep: int) -> dict[str, dict]:
    per_seq = -(-seq_len // BLOCK_SIZE)
    rows = {}
    for f in ["auto", *formats]:
        if f.startswith("adaptive"):
            rows.update(adaptive_capacity(cfg, f, budget, seq_len, keep))
            continue
        blocks = choose_num_blocks(cfg, BLOCK_SIZE, torch.bfloat16, None, budget, 0, f)
        rows[f] = {"blocks": blocks, "bytes_per_token": bytes_per_block(cfg, BLOCK_SIZE, torch.bfloat16, f)
                   / BLOCK_SIZE, "sequences": blocks // per_seq}
    return rows


def adaptive_capacity(cfg, variant: str, budget: int, seq_len: int, keep: int) -> dict[str, dict]:
    """Each sequence holds its newest `keep` tokens plus one partial page hot, the rest in FP4; rows for the
    engine's default share of the budget and for the share that fills both regions at once."""
    hot_format = "fp8" if variant == "adaptive-fp8" else "auto"
    hot_bytes, cold_bytes = (bytes_per_block(cfg, BLOCK_SIZE, torch.bfloat16, f) for f in (hot_format, COLD_FORMAT))
    hot_per_seq = min(-(-keep // BLOCK_SIZE) + 1, -(-seq_len // BLOCK_SIZE))
    cold_per_seq = -(-seq_len // BLOCK_SIZE) - hot_per_seq
    balanced = cold_per_seq * cold_bytes / (cold_per_seq * cold_bytes + hot_per_seq * hot_bytes)
    rows = {}
    for share in (EngineConfig.kv_compress_share, round(balanced, 3)):
        hot, cold = split_kv_budget(cfg, BLOCK_SIZE, torch.bfloat16, hot_format, None, budget, 0, share)
        fits = min(hot // hot_per_seq, cold // cold_per_seq if cold_per_seq else hot)
        rows[f"{variant} (share {share})"] = {
            "blocks": f"{hot} + {cold} fp4", "sequences": fits,
            "bytes_per_token": (hot_per_seq * hot_bytes + cold_per_seq * cold_bytes) / BLOCK_SIZE
                               / (hot_per_seq + cold_per_seq)}
    return rows


# ------------------------------------------------------------------------------------------ report

def print_tables(results: dict, args: argparse.Namespace) -> None:
    name = {"auto": "bf16", "fp8:K": "fp8 keys only", "fp8:V": "fp8 values only",
            "fp4:K": "fp4 keys only", "fp4:V": "fp4 values only",
            "adaptive": f"adaptive: newest {args.compress_after} bf16, older fp4",
            "adaptive-fp8": f"adaptive: newest {args.compress_after} fp8, older fp4"}
    for mode, table in results.get("teacher_forced", {}).items():
        print(f"\nteacher-forced, {mode} writes: {table['auto']['tokens']} positions of English text")
        print("| KV | KL mean | KL p99 | KL max | top-1 agree | ppl |\n|---|---|---|---|---|---|")
        for f, r in table.items():
            print(f"| {name.get(f, f)} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['kl_max']:.2e} | "
                  f"{r['top1']:.4f} | {r['ppl']:.3f} |")
    if "chat" in results:
        print(f"\ngreedy chat agreement with bf16 KV ({len(CHAT_PROMPTS)} prompts, {args.chat_tokens} tokens)")
        print("| KV | first 16 identical | all identical | mean length | lengths |\n|---|---|---|---|---|")
        for f, r in results["chat"].items():
            print(f"| {f} | {r['identical_16']}/{len(CHAT_PROMPTS)} | {r['identical_all']}/{len(CHAT_PROMPTS)} | "
                  f"{r['mean']:.1f} | {r['lengths']} |")
    if "speed" in results:
        print(f"\ndecode, {args.decode_batch} sequences, {args.decode_context} tokens of context each "
              f"(median of {args.rounds} rounds)")
        print("| KV | tokens/s | rounds |\n|---|---|---|")
        for f, r in results["speed"].items():
            print(f"| {name.get(f, f)} | {r['tok_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['all'])} |")
    if "capacity" in results:
        print(f"\n{args.seq_len}-token sequences in a {args.budget_mib} MiB KV pool")
        print("| KV | bytes/token | blocks | sequences |\n|---|---|---|---|")
        for f, r in results["capacity"].items():
            print(f"| {name.get(f, f)} | {r['bytes_per_token']:.0f} | {r['blocks']} | {r['sequences']} |")


def checkpoint(results: dict, args: argparse.Namespace) -> None:
    """Print what is done so far (a long run that gets killed still leaves its finished tables)."""
    print(f"--- {time.strftime('%H:%M:%S')}: {', '.join(k for k in results if isinstance(results[k], dict))} done",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default="fp8,fp4,adaptive",
                   help="page formats (fp8, fp4) and adaptive compression variants (adaptive, adaptive-fp8)")
    p.add_argument("--compress-after", type=int, default=128,
                   help="adaptive: the newest tokens of each sequence that stay uncompressed")
    p.add_argument("--diagnostics", default="fp8:K,fp8:V",
                   help="extra pools for the `pages` mode: FORMAT:K quantises only keys, FORMAT:V only values")
    p.add_argument("--windows", type=int, default=23)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--modes", default="decode,pages", help="teacher-forced write patterns")
    p.add_argument("--chat-tokens", type=int, default=64)
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of: teacher_forced, chat, speed, capacity")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    page_formats = [f for f in formats if not f.startswith("adaptive")]
    diagnostics = [f for f in args.diagnostics.split(",") if f]
    skip = set(args.skip.split(","))
    base = LLM(args.model, num_kv_blocks=4, num_threads=args.threads)  # bf16: the serving dtype
    windows = corpus_windows(base.tokenizer, args.window, args.windows)
    results: dict = {"load_avg_start": os.getloadavg()[0]}
    started = time.perf_counter()
    if "teacher_forced" not in skip:
        results["teacher_forced"] = {}
        for mode in args.modes.split(","):
            chunk, variants = (1, formats) if mode == "decode" else (PAGES_CHUNK, formats + diagnostics)
            results["teacher_forced"][mode] = teacher_forced(base.engine.runner.model, windows, variants, chunk,
                                                             base.engine.dtype, args.compress_after)
            checkpoint(results, args)
    if "chat" not in skip:
        results["chat"] = chat_agreement(args.model, page_formats, args.chat_tokens, args.threads)
        checkpoint(results, args)
    if "speed" not in skip:
        results["speed"] = decode_speed(args.model, page_formats, windows, args.decode_batch, args.decode_context,
                                        args.decode_steps, args.rounds, args.threads)
        checkpoint(results, args)
    if "capacity" not in skip:
        results["capacity"] = capacity(base.engine.source.config, formats, args.budget_mib << 20, args.seq_len,
                                       args.compress_after)
    results["seconds"] = time.perf_counter() - started
    results["load_avg_end"] = os.getloadavg()[0]
    print_tables(results, args)
    print(f"\n{results['seconds']:.0f} s; load average {results['load_avg_start']:.1f} at start, "
          f"{results['load_avg_end']:.1f} at end (2 cores, shared with other processes)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
