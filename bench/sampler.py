"""What the sampling controls cost the sampler per step: one SamplingBatch.build plus one sample() on random
logits, as the runner does each decode step, with and without penalties, logit_bias and min_p.

    python -m bench.sampler [--batches 1,32,64] [--vocab 49152] [--history 256,2048] [--repeats 30]
                            [--threads 2] [--device cpu]

Variants, taking turns within each round (so a slow minute of a shared host hits them alike):
- plain: temperature 0.8, top-p 0.95, no controls (what every request paid before the controls existed);
- bias: plain with 16 logit_bias entries; min_p: plain with min_p 0.05;
- penalties: plain with presence, frequency and repetition penalties over a history of H tokens per row
  (half prompt, half output);
- all: every control at once; half: every other row as in "all", the rest plain;
- greedy, greedy+bias, greedy+pen: temperature 0 without controls, with the biases, with the penalties
  (greedy decoding's own fast path: an argmax, no softmax).
Prints the median milliseconds per step and, in brackets, the median of each variant's per-round ratios to its
baseline (plain or greedy) from the same round.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

import torch

from engine.sampling.sampler import History, SamplingBatch, sample
from engine.sampling.sampling_params import SamplingParams

PLAIN = dict(temperature=0.8, top_p=0.95)
GREEDY = dict(temperature=0.0)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def variants(vocab: int) -> dict[str, tuple[list[dict], dict]]:
    """name -> (per-row params of a two-row pattern, the baseline it is compared with)."""
    rng = random.Random(0)
    bias = dict(logit_bias={t: rng.uniform(-5, 5) for t in rng.sample(range(vocab), 16)})
    every = {**PLAIN, **PENALTIES, **bias, "min_p": 0.05}
    return {
        "plain": ([PLAIN], PLAIN),
        "bias": ([{**PLAIN, **bias}], PLAIN),
        "min_p": ([{**PLAIN, "min_p": 0.05}], PLAIN),
        "penalties": ([{**PLAIN, **PENALTIES}], PLAIN),
        "all": ([every], PLAIN),
        "half": ([every, PLAIN], PLAIN),
        "greedy": ([GREEDY], GREEDY),
        "greedy+bias": ([{**GREEDY, **bias}], GREEDY),
        "greedy+pen": ([{**GREEDY, **PENALTIES}], GREEDY),
    }


def histories(batch: int, length: int, vocab: int) -> list[History]:
    rng = random.Random(length)
    return [History(tuple(rng.randrange(vocab) for _ in range(length)), length // 2) for _ in range(batch)]


def step_ms(logits: torch.Tensor, params: list[SamplingParams], hist: list[History], device: str) -> float:
    """One build + sample, as ModelRunner._sample runs them (histories only where a row is penalised)."""
    wanted = [h if p.penalised else None for p, h in zip(params, hist)]
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    batch = SamplingBatch.build(params, [None] * len(params), [()] * len(params), device,
                                wanted if any(p.penalised for p in params) else None)
    sample(logits, batch)  # .tolist() inside waits for the device
    return (time.perf_counter() - start) * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,32,64")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--history", default="256,2048", help="tokens per row that the penalties count")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    table = variants(a.vocab)
    print(f"vocab {a.vocab}, device {a.device}, {a.threads} threads, median ms per build + sample over "
          f"{a.repeats} rounds (median paired ratio to plain or greedy)")
    print("| batch | history | " + " | ".join(table) + " |")
    print("|---|---|" + "---|" * len(table))
    for batch in (int(b) for b in a.batches.split(",")):
        logits = torch.randn(batch, a.vocab, generator=torch.Generator().manual_seed(batch)).to(a.device)
        for length in (int(h) for h in a.history.split(",")):
            hist = histories(batch, length, a.vocab)
            rows = {name: [SamplingParams(**pattern[i % len(pattern)]) for i in range(batch)]
                    for name, (pattern, _) in table.items()}
            times: dict[str, list[float]] = {name: [] for name in table}
            for _ in range(a.repeats + 2):
                for name, params in rows.items():
                    times[name].append(step_ms(logits, params, hist, a.device))
            kept = {name: t[2:] for name, t in times.items()}  # the first two rounds warm up
            med = {name: statistics.median(t) for name, t in kept.items()}
            base = {name: "greedy" if b is GREEDY else "plain" for name, (_, b) in table.items()}
            ratio = {name: statistics.median(x / y for x, y in zip(kept[name], kept[base[name]])) for name in table}
            cells = [f"{med[n]:.3f}" if base[n] == n else f"{med[n]:.3f} ({ratio[n]:.2f})" for n in table]
            print(f"| {batch} | {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
