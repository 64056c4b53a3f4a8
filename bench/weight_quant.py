"""int8 and int4 weights (--weight-dtype int8 / int4) against bf16 weights on the default model: speed,
accuracy, memory.

    python -m bench.weight_quant [--rounds 7] [--steps 64] [--context 128] [--windows 8] [--window 256]
        [--threads 2] [--batch 1,8] [--variants bf16,int8-w8a8,int4,...] [--model PATH] [--json OUT]
        [--skip speed,accuracy,memory]

1. Decode tokens/s at each `--batch` (default 1 and 8 sequences), each with `--context` tokens of English text
   before it, `--steps` timed decode steps (bench.kv_accuracy.decode_rate), the variants alternated over `--rounds`
   in one process; medians, and the median of the per-round ratios to bf16. Variants, on the C++ decode stack
   unless named -layers: bf16; int8-widen, the int8 kernel that widens the weights to fp32 against fp32
   activations (max_w8a8_rows 0); int8-w8a8, the W8A8 kernel (each activation row quantised to int8, int32 sums
   on AVX-512 VNNI; on a CPU without VNNI it is int8-widen again); int8-layers, the shipped int8 kernels from the
   Python layer loop (decode_stack off); int4, the shipped int4 kernels (engine/kernels/int4_linear.cpp: the
   weight-only kernel, bf16 activations); int4-w4a8, the W4A8 kernel (activations quantised to int8, VNNI;
   off by default: it fails the accuracy gate); int4-dequant, every product on the weight dequantised to bf16
   for F.linear (max_int4_rows 0); int4-layers, the shipped kernels from the Python layer loop; int4-torch, the
   same int4 codes on torch's own kernel (aten._weight_int4pack_mm_for_cpu, bf16 scales and zeros) from the
   Python layer loop, against int4-layers; auto, what --weight-dtype auto loads (for the default Q4_1 file: int4
   layers, a bf16 LM head); auto-dequant, it with max_int4_rows 0. Every engine runs on the dispatch table it
   measured at start, but a variant that changes a row limit runs on the shipped table with that limit changed.
2. Teacher-forced accuracy on the English text bench/kv_accuracy.py uses (the Debian license texts): `--windows`
   windows of `--window` tokens fed one token a step as decode rows (the quantised kernels' path) through bf16
   and each quantised kernel; KL(bf16 || quantised) mean and p99, top-1 agreement, and each model's perplexity of
   the real next token.
3. Resident memory after load: a fresh process per variant builds the engine (64 KV blocks) and reports its RSS
   before and after, and the bytes of the model's own tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: the cores are shared

import torch  # noqa: E402

from bench.kv_accuracy import Scores, corpus_windows, decode_rate, forced_steps  # noqa: E402
from engine import LLM  # noqa: E402
from engine.backends import CpuKernelBackend  # noqa: E402
from engine.backends import weight_ops  # noqa: E402
from engine.backends.cpu_config import CpuKernelConfig  # noqa: E402
from engine.backends.dispatch import FALLBACKS  # noqa: E402
from engine.backends.weight_ops import Weight  # noqa: E402
from engine.model import quant  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402

VARIANTS = ("bf16", "int8-widen", "int8-w8a8", "int8-layers", "int4", "int4-w4a8", "int4-dequant", "int4-layers",
            "int4-torch", "auto", "auto-dequant")
QUANTISED = ("int8-widen", "int8-w8a8", "int4", "auto")  # the accuracy part scores each against bf16
MEMORY = ("bf16", "int8-w8a8", "int4", "auto")  # the memory part loads each in a process of its own
# each variant's weight dtype and changes to the shipped CpuKernelConfig
CONFIG = {"bf16": {}, "int8-widen": {"max_w8a8_rows": 0}, "int8-w8a8": {}, "int8-layers": {"decode_stack": False},
          "int4": {}, "int4-w4a8": {"max_w4a8_rows": 64}, "int4-dequant": {"max_int4_rows": 0},
          "int4-layers": {"decode_stack": False}, "int4-torch": {"decode_stack": False}, "auto": {},
          "auto-dequant": {"max_int4_rows": 0}}


def weight_dtype(variant: str) -> str:
    return "bfloat16" if variant == "bf16" else variant[:4]


class TorchInt4Backend(CpuKernelBackend):
    """The int4 products that the dispatch table gives an int4 kernel, on torch's kernel instead
    (aten._weight_int4pack_mm_for_cpu) on a copy of the codes in its format: its scales and zeros are bf16 [G, N, 2]
    with w = (q - 8) s + zero, so zero = z + 8 s. K must be a multiple of 32 (SmolLM2's are)."""

    def __init__(self, config: CpuKernelConfig) -> None:
        super().__init__(config)
        self.torch_int4: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(codes) -> its copies

    def prepare_linear(self, data: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None) -> Weight:
        if scale is not None and weight_ops.is_int4(data):
            self.torch_int4[id(data)] = (data, *torch_int4pack(data, scale))
        return super().prepare_linear(data, bias, scale)

    def linear_int4(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        entry = self.torch_int4.get(id(w.data))
        if entry is None or entry[0] is not w.data or self.dispatch.int4.kernel(x.shape[0]) in FALLBACKS:
            return super().linear_int4(x, w)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, entry[1], weight_ops.INT4_GROUP, entry[2])
        return out if w.bias is None else out + w.bias


def torch_int4pack(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, groups = weight_ops.int4_channels(scales), scales.shape[1]
    codes = weight_ops.unpack_int4(packed, torch.arange(n))[:, :groups * weight_ops.INT4_GROUP].to(torch.int32)
    s, z = (part.T.float() for part in weight_ops.int4_scales_of(scales, torch.arange(n)))  # [G, N]
    zeros = torch.stack([s, z + 8 * s], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), zeros


def build(model: str | None, variant: str, threads: int, blocks: int) -> LLM:
    llm = LLM(model, dtype="bfloat16", weight_dtype=weight_dtype(variant), num_kv_blocks=blocks,
              num_threads=threads, max_num_seqs=8)
    if CONFIG[variant]:
        runner = llm.engine.runner
        backend = TorchInt4Backend if variant == "int4-torch" else CpuKernelBackend
        changes = dict(CONFIG[variant])
        if any(name.startswith("max_") for name in changes):  # a row limit: on the shipped table, with it changed
            changes["dispatch"] = None
        runner.set_backend(backend(replace(runner.backend.config, **changes)))
    return llm


def speed(llms: dict[str, LLM], prompts: list[list[int]], steps: int, rounds: int) -> dict:
    rates: dict[str, list[float]] = {v: [] for v in llms}
    for _ in range(rounds):
        for v, llm in llms.items():
            rates[v].append(decode_rate(llm, prompts, steps))
    out = {}
    for v, r in rates.items():
        ratios = [a / b for a, b in zip(r, rates["bf16"] if "bf16" in rates else r)]
        out[v] = {"tok_s": statistics.median(r), "vs_bf16": statistics.median(ratios), "all": r}
    return out


@torch.inference_mode()
def accuracy(models: dict[str, LlamaModel], windows: list[list[int]]) -> dict:
    """The models fed the windows in lockstep, one token a step (decode rows); every position but the last.
    -> per quantised variant: its KL / top-1 against bf16 and its perplexity; "bf16": bf16's perplexity."""
    runs = {v: forced_steps(m, windows, "auto", 1, torch.bfloat16, 0) for v, m in models.items()}
    scores, own = {v: Scores() for v in models if v != "bf16"}, {v: Scores() for v in models}
    length = len(windows[0])
    for pos in range(length - 1):
        logp = {v: next(run).log_softmax(-1) for v, run in runs.items()}
        targets = torch.tensor([w[pos + 1] for w in windows])
        for v in scores:
            scores[v].add(logp["bf16"], logp[v], targets)
        for v in models:
            own[v].add(logp[v], logp[v], targets)
    out = {v: s.summary() | {"ppl": own[v].summary()["ppl"]} for v, s in scores.items()}
    out["bf16"] = {"ppl": own["bf16"].summary()["ppl"]}
    return out


def rss_child(model: str | None, variant: str, threads: int) -> dict:
    import psutil

    torch.set_num_threads(threads)
    before = psutil.Process().memory_info().rss
    llm = build(model, variant, threads, 64)
    after = psutil.Process().memory_info().rss
    net = llm.engine.runner.model
    tensors = sum(t.numel() * t.element_size() for t in list(net.parameters()) + list(net.buffers()))
    tensors += sum(s.numel() * s.element_size() for s in quant.weight_scales(net).values())
    return {"rss_before_mib": before / 2 ** 20, "rss_after_mib": after / 2 ** 20,
            "load_mib": (after - before) / 2 ** 20, "model_tensors_mib": tensors / 2 ** 20}


def memory(model: str | None, threads: int, variants: list[str]) -> dict:
    out = {}
    for v in (v for v in MEMORY if v in variants):
        cmd = [sys.executable, "-m", "bench.weight_quant", "--rss-child", v, "--threads", str(threads)]
        if model:
            cmd += ["--model", model]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[v] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def print_tables(results: dict, args: argparse.Namespace) -> None:
    for batch, speeds in results.get("speed", {}).items():
        print(f"\nbatch-{batch} decode, {args.context} tokens of context, {args.steps} steps, {args.rounds} rounds "
              f"alternated, {args.threads} threads")
        print(f"{'variant':<12} {'tok/s (median)':>15} {'x bf16 (median of rounds)':>27}")
        for v, r in speeds.items():
            print(f"{v:<12} {r['tok_s']:>15.1f} {r['vs_bf16']:>27.2f}")
    if "accuracy" in results:
        a = results["accuracy"]
        tokens = next(r["tokens"] for v, r in a.items() if v != "bf16")
        print(f"\nteacher-forced against bf16 weights: {tokens} positions of English text (decode rows); "
              f"ppl bf16 {a['bf16']['ppl']:.3f}")
        for v, r in a.items():
            if v != "bf16":
                print(f"{v:<12} KL mean {r['kl_mean']:.5f}  p99 {r['kl_p99']:.5f}  max {r['kl_max']:.4f}  "
                      f"top-1 {r['top1']:.4f}  ppl {r['ppl']:.3f}")
    if "memory" in results:
        print("\nresident memory after load (fresh process each, 64 KV blocks)")
        print(f"{'variant':<10} {'RSS before':>11} {'RSS after':>10} {'load':>8} {'model tensors':>14}  (MiB)")
        for v, m in results["memory"].items():
            print(f"{v:<10} {m['rss_before_mib']:>11.1f} {m['rss_after_mib']:>10.1f} {m['load_mib']:>8.1f} "
                  f"{m['model_tensors_mib']:>14.1f}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", default="1,8", help="comma-separated: the sequences decoded together in each speed "
                   "table (at most 8)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--skip", default="", help="comma-separated: speed, accuracy, memory")
    p.add_argument("--rss-child", choices=VARIANTS, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.rss_child:
        print(json.dumps(rss_child(args.model, args.rss_child, args.threads)))
        return
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    results: dict = {}
    if "memory" not in skip:  # first: the children load while this process is still small
        results["memory"] = memory(args.model, args.threads, variants)
    if not {"speed", "accuracy"} <= skip:
        blocks = max(args.windows * -(-args.window // 16),
                     max(batches) * -(-(args.context + args.steps + 8) // 16)) * 2 + 8
        llms = {v: build(args.model, v, args.threads, blocks) for v in variants}
        windows = corpus_windows(next(iter(llms.values())).tokenizer, max(args.window, args.context), args.windows)
        if "speed" not in skip:
            results["speed"] = {}
            for batch in batches:
                prompts = [windows[i % len(windows)][:args.context] for i in range(batch)]
                results["speed"][batch] = speed(llms, prompts, args.steps, args.rounds)
        if "accuracy" not in skip and "bf16" in llms:
            models = {v: llms[v].engine.runner.model for v in ("bf16", *QUANTISED) if v in llms}
            results["accuracy"] = accuracy(models, [w[:args.window] for w in windows])
    print_tables(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
