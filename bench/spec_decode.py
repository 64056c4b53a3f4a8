"""Speculative decoding on the default model: output tokens/s with and without speculation, acceptance rates.

    python -m bench.spec_decode [--batch-sizes 1,8] [--modes off,ngram,self:8,self:15] [--workloads repeat,chat]
        [--output-len 128] [--rounds 3] [--k 4] [--threads 2] [--dtype bfloat16] [--model PATH] [--json OUT]

Two chat workloads, greedy, EOS respected: `repeat` asks the model to rewrite given code or text (a SILO request
whose output repeats its prompt, so prompt lookup hits) and `chat` asks open questions. At batch 1 the requests
run one after another; at batch B, B requests run together. Every round runs every configuration back to back
(one engine per mode, built once; prefix caching off so that every round does the same work), so a burst of
load from other processes hits neighbours alike. Tokens/s = output tokens / wall time, prefill included; cpu
tok/s = output tokens / CPU time of this process, which other processes disturb less. The table shows medians
over the rounds; speedups are medians of the per-round ratios to `off` (paired). `agree` is the share of
outputs identical to speculation off: greedy verification is exact, but in bfloat16 a K+1-token verification
chunk and a one-token decode step round differently, so a near-tie can flip a token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: the cores are shared

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.core.stats import EngineStats  # noqa: E402

CODE = [
    '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
    '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        return items[:n]''',
    '''def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        middle = (low + high) // 2
        if values[middle] == target:
            return middle
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1''',
    '''import json

def load_config(path):
    with open(path) as handle:
        config = json.load(handle)
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 8000)
    config.setdefault("workers", 4)
    return config''',
]
TEXT = [
    "The museum opens at nine in the morning and closes at six in the evening. Tickets can be bought at the "
    "entrance or online. Children under twelve enter for free. Guided tours start every hour from the main hall.",
    "To make the bread, mix the flour, the water, the salt and the yeast in a large bowl. Knead the dough for ten "
    "minutes, cover it and let it rise for two hours. Shape the loaf and bake it for forty minutes.",
    "The train to the coast leaves from platform four at ten past eight. It stops at every station until the "
    "river, then runs fast to the harbour. Bicycles travel in the last carriage; dogs travel with their owners.",
    "Our team meets every Monday to plan the week. Each person lists what they finished, what they will do "
    "next and what blocks them. Notes go to the shared folder and the action items go to the tracker.",
]
CHAT = [
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me some tips for a good night's sleep.",
    "What are the main differences between a lake and a sea?",
    "Write a short story about a robot that learns to paint.",
    "How do I start learning to play the guitar?",
    "What should I pack for a weekend hiking trip?",
    "Explain what a compiler does in simple words.",
    "Describe a perfect autumn day in a small town.",
]


def workload(name: str) -> list[list[dict]]:
    if name == "repeat":
        code = [f"Here is some code:\n\n```python\n{c}\n```\n\nCopy the code above exactly, character for character."
                for c in CODE]
        text = [f"Here is a paragraph:\n\n{t}\n\nCopy the paragraph above exactly, word for word." for t in TEXT]
        prompts = [p for pair in zip(code, text) for p in pair]
    else:
        prompts = CHAT
    return [[{"role": "user", "content": p}] for p in prompts]


@dataclass
class Run:
    tokens: int
    seconds: float
    cpu_seconds: float
    proposed: int
    accepted: int
    steps: int
    outputs: list[list[int]] = field(repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds


@dataclass
class Cell:
    workload: str
    batch: int
    mode: str
    runs: list[Run] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs)

    def speedup(self, off: Cell | None, attr: str) -> float:
        """Median over rounds of this mode's rate over `off`'s rate in the same round."""
        if off is None:
            return float("nan")
        return statistics.median(getattr(r, attr) / getattr(o, attr) for r, o in zip(self.runs, off.runs))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(mode: str, args: argparse.Namespace) -> LLM:
    spec = {} if mode == "off" else dict(speculative="ngram") if mode == "ngram" else \
        dict(speculative="draft", draft_model=mode)
    return LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory=256 << 20,
               max_num_seqs=max(args.batch_list), num_speculative_tokens=args.k, enable_prefix_caching=False,
               **spec)


def measure(llm: LLM, conversations: list[list[dict]], batch: int, params: SamplingParams) -> Run:
    before = llm.engine.stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = []
    for i in range(0, len(conversations), batch):
        outputs += [o.outputs[0].token_ids for o in llm.chat(conversations[i:i + batch], params)]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    after = llm.engine.stats()
    return Run(sum(map(len, outputs)), seconds, cpu_seconds, *_spec_delta(before, after), outputs)


def _spec_delta(before: EngineStats, after: EngineStats) -> tuple[int, int, int]:
    return (after.spec_proposed - before.spec_proposed, after.spec_accepted - before.spec_accepted,
            after.spec_steps - before.spec_steps)


def conversations_for(name: str, batch: int, per_batch1: int) -> list[list[dict]]:
    convs = workload(name)
    return convs[:per_batch1] if batch == 1 else (convs * batch)[:batch]


def run_rounds(args: argparse.Namespace, engines: dict[str, LLM]) -> list[Cell]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    cells = {(w, b, m): Cell(w, b, m) for w in args.workload_list for b in args.batch_list for m in engines}
    for round_index in range(args.rounds):
        for w in args.workload_list:
            for b in args.batch_list:
                convs = conversations_for(w, b, args.batch1_requests)
                for mode, llm in engines.items():
                    run = measure(llm, convs, b, params)
                    cells[w, b, mode].runs.append(run)
                    log(f"round {round_index + 1} {w:<6} B={b:<2} {mode:<8} {run.tokens_per_s:6.1f} tok/s "
                        f"({run.tokens} tokens, {run.seconds:.1f} s, accepted {run.accepted}/{run.proposed})")
    return list(cells.values())


def agreement(cell: Cell, off: Cell | None) -> float:
    if off is None:
        return float("nan")
    pairs = [(a, b) for r, o in zip(cell.runs, off.runs) for a, b in zip(r.outputs, o.outputs)]
    return sum(a == b for a, b in pairs) / len(pairs)


def print_table(cells: list[Cell]) -> None:
    index = {(c.workload, c.batch, c.mode): c for c in cells}
    print(f"{'workload':<8} {'batch':>5} {'mode':<8} {'tok/s':>6} {'speedup':>7} {'cpu tok/s':>9} {'speedup':>7} "
          f"{'accept':>6} {'acc/step':>8} {'drafts/step':>11} {'agree':>5}  runs tok/s")
    for c in cells:
        off = index.get((c.workload, c.batch, "off"))
        proposed, accepted, steps = (sum(getattr(r, a) for r in c.runs) for a in ("proposed", "accepted", "steps"))
        rate = f"{accepted / proposed:.0%}" if proposed else "-"
        per_step = f"{accepted / steps:.2f}" if steps else "-"
        drafts = f"{proposed / steps:.2f}" if steps else "-"
        runs = ", ".join(f"{r.tokens_per_s:.1f}" for r in c.runs)
        print(f"{c.workload:<8} {c.batch:>5} {c.mode:<8} {c.median('tokens_per_s'):6.1f} "
              f"{c.speedup(off, 'tokens_per_s'):6.2f}x {c.median('tokens_per_cpu_s'):9.1f} "
              f"{c.speedup(off, 'tokens_per_cpu_s'):6.2f}x {rate:>6} {per_step:>8} {drafts:>11} "
              f"{agreement(c, off):5.0%}  {runs}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--modes", default="off,ngram,self:8,self:15", help="off, ngram, self:N or a draft model path")
    p.add_argument("--workloads", default="repeat,chat")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-requests", type=int, default=4, help="requests run one after another at batch 1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--model", default=None, help="HF folder or .gguf file; default: SmolLM2-135M GGUF")
    p.add_argument("--json", default=None, help="write all runs to this file")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engines = {mode: build(mode, args) for mode in args.mode_list}
    for llm in engines.values():
        llm.chat(workload("chat")[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    cells = run_rounds(args, engines)
    print(f"model {next(iter(engines.values())).engine.source.name}, dtype {args.dtype}, threads {args.threads}, "
          f"K {args.k}, output up to {args.output_len} tokens (greedy, EOS respected), {args.rounds} rounds, "
          f"batch 1 = {args.batch1_requests} requests one after another, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load average {os.getloadavg()[0]:.1f}")
    print_table(cells)
    print("accept = accepted / proposed drafts; acc/step = mean accepted drafts per verification; figures are "
          "medians of noisy runs on a shared machine")
    if args.json:
        doc = [{**{k: v for k, v in asdict(c).items() if k != "runs"},
                "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in c.runs]} for c in cells]
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
