"""Steady decode at a fixed batch, for a sampling profiler, and a summary of what py-spy saw.

    py-spy record --format raw -r 250 -o /tmp/spy.txt -- python -m bench.decode_loop [--batch 64] [--seconds 12]
    python -m bench.decode_loop --summarise /tmp/spy.txt

The first command prefills `--batch` prompts of `--input-len` random tokens, then steps the engine for
`--seconds` (greedy, no EOS). The second reads py-spy's raw (collapsed) stacks, keeps the samples taken in
those decode steps, and splits them by their innermost frame: a line that calls into C (a torch op, one of our
kernels) or pure Python (module dispatch, metadata, checks). torch.profiler cannot make that split for our
pybind kernels and inflates every op it times; sampling does neither.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path

# Innermost frames that are calls into C: their samples are time in torch ops or our kernels (decode_layers: the
# decoder layers of a decode-only step as one C++ call).
C_CALL_SITES = ("decode_layers (", "OpOverloadPacket.__call__", "decode_attention_", "silu_mul (", "rms_norm (",
                "rotary_ (", "linear_bf16 (", "tiled_linear (", "tiled_linear_silu_mul (", "tiled_linear_argmax (",
                "onednn_linear (", "prompt_attention (", "_prefill_attention (", "row_argmax", "_write (",
                "compute_logits (", "Tensor.split (", "embedding (", "linear (engine/backends/", "linear (cpu_kernels.py",
                "linear (torch_ops.py")


def run(batch: int, input_len: int, seconds: float, threads: int) -> None:
    import torch

    from engine import LLM, SamplingParams
    from engine.core.engine_core import EngineRequest

    torch.set_num_threads(threads)
    llm = LLM(max_num_seqs=batch, num_threads=threads)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(100, 40_000) for _ in range(input_len)]
        llm.engine.add_request(EngineRequest(f"r{i}", prompt, params, arrival_time=time.monotonic()))
    while llm.engine.scheduler.waiting or not all(s.prefill_done for s in llm.engine.scheduler.running):
        llm.engine.step()
    decode_for(llm, seconds)


def decode_for(llm, seconds: float) -> None:
    """The decode steps: `summarise` keeps only the samples taken under this function."""
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        llm.engine.step()
        steps += 1
    print(f"{len(llm.engine.scheduler.running)} sequences: {steps} decode steps, "
          f"{(time.perf_counter() - start) / steps * 1e3:.1f} ms each")


def summarise(path: Path, top: int) -> None:
    leaves: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any(f.startswith("decode_for (") for f in frames):
            leaves[frames[-1]] += int(count)
    total = sum(leaves.values())
    if not total:
        raise SystemExit(f"no samples under decode_for in {path}")
    python = {f: n for f, n in leaves.items() if not any(site in f for site in C_CALL_SITES)}
    print(f"{total} samples in decode steps; innermost frame in Python (not a call into C): "
          f"{sum(python.values()) / total:.1%}")
    print("top innermost frames:")
    for frame, n in leaves.most_common(top):
        print(f"  {n / total:6.1%}  {'py ' if frame in python else 'C  '} {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--summarise", type=Path, default=None, metavar="RAW", help="summarise py-spy raw output")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    if a.summarise:
        summarise(a.summarise, a.top)
    else:
        run(a.batch, a.input_len, a.seconds, a.threads)


if __name__ == "__main__":
    main()
