"""The accuracy gate of the CPU kernels: each kernel path against the plain-torch reference of the same weights.

    python -m bench.kernel_accuracy [--model PATH] [--formats bfloat16,int8,int4,auto] [--windows 4] [--length 192]
        [--kernels shipped,w4a8,w8a8,int4_gemm,int4_bf16,int8g_bf16] [--threads 2] [--json OUT]

For each weight format the model is loaded twice with identical weights: once on plain torch ops (`TorchBackend`,
what `--enforce-eager` runs: the format's reference) and once on each kernel set under test. Both are fed the
same English text (the license texts `bench/kv_accuracy.py` reads) in lockstep, teacher-forced, and every position's
next-token distribution of the kernels is scored against the reference's: KL(reference || kernels) mean and
p99, and top-1 agreement.

The feeding schedule makes every row-count regime of the dispatch table run (engine/backends/cpu_kernels.py):
a first prefill chunk of all windows together (hundreds of rows: the large-row products and prompt attention),
mid-sized chunks (tens of rows: the small-batch kernels and chunked prefill against the cache), decode steps of
every window (a few rows: packed products and the decode stack), then decode steps of one window (one row: the
GEMV and one-row kernels).

Kernel sets: `shipped` is `CpuKernelBackend()` on this CPU (the shipped dispatch table); `w4a8` / `w8a8` force the
int8-activation kernels for every row count they take (their scalar loop where this CPU lacks AVX-512 VNNI), to
measure the activation format itself; `int4_gemm` / `int4_bf16` / `int8g_bf16` give every product of their format
up to their row cap (CpuKernelConfig.row_caps) to the AVX-512 int4 GEMM / the int4 or int8g product on bf16 dot
products, as a measured table may. `floor` gives every product to F.linear in the reference's own bf16 math,
`floor32` to F.linear in fp32 on the exact weights (`linear32`, which the shipped table names on a CPU without bf16
dot products): each is as far from the reference as the rounding order alone puts a model. tests/test_kernel_accuracy.py
runs `shipped` on the real models (and those on the int4 and `auto` weights they serve).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: the cores are shared

import torch  # noqa: E402

from bench.kv_accuracy import Scores, corpus_windows  # noqa: E402
from engine.backends import weight_ops  # noqa: E402
from engine.backends.attention import AttentionMetadata  # noqa: E402
from engine.backends.base import Backend  # noqa: E402
from engine.backends.cpu_config import CpuKernelConfig  # noqa: E402
from engine.backends.cpu_kernels import CpuKernelBackend  # noqa: E402
from engine.backends.dispatch import FORMATS as DISPATCH_FORMATS, Route  # noqa: E402
from engine.backends.torch_ops import TorchBackend  # noqa: E402
from engine.backends.weight_ops import Weight  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.model.gguf_loader import default_model_path  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.loader import ModelSource, load_model, resolve_model  # noqa: E402

BLOCK_SIZE = 16
FORMATS = ("bfloat16", "int8", "int4", "auto")
GEMMS = {"int4_gemm": "int4", "int4_bf16": "int4", "int8g_bf16": "int8g"}  # kernel set -> the format it serves
# The gate's bounds (tests/test_kernel_accuracy.py). A kernel computes the same weights as its reference and
# differs only in rounding order and bf16 intermediates; an activation format that drops information (int8
# activations of a model with outlier channels) shows as a KL mean several times larger. The KL bound sits
# between the two, the top-1 bound below the near-ties that fp32 logits order by that rounding noise. Figures:
# docs/performance.md, "The accuracy gate".
MIN_TOP1 = 0.98  # of top1_ties (see there)
MAX_KL_MEAN = 0.005
# Past MAX_KL_MEAN a kernel set still passes when the `floor` set (every product through the reference's own math,
# so only the attention, norm and rope kernels round differently) is as far from the reference: the weights' format
# made the model that sensitive to rounding order, and the product kernels add at most FLOOR_MARGIN to it. Gemma 3
# 270M with int4 weights (Q5_0 / Q6_K / Q8_0 tensors rounded again to 4 bits) is such a model on an AVX-512 BF16
# CPU: its prompt attention kernel's error against float64 equals SDPA's, yet the two orders of rounding part by a
# KL mean of 0.006 there. FLOOR_CAP keeps a broken shared kernel failing.
FLOOR_MARGIN = 1.1
FLOOR_CAP = 2 * MAX_KL_MEAN


def within_bound(kl_mean: float, floor_kl_mean: float | None) -> bool:
    """The gate's KL rule: under MAX_KL_MEAN, or (given the floor's KL mean) within FLOOR_MARGIN of a floor that
    is itself under FLOOR_CAP."""
    if kl_mean <= MAX_KL_MEAN:
        return True
    return floor_kl_mean is not None and floor_kl_mean <= FLOOR_CAP and kl_mean <= FLOOR_MARGIN * floor_kl_mean


@dataclass(frozen=True)
class Schedule:
    """How the text is fed: `prefill` tokens of every window in one step, then chunks of `chunk`, then one token a
    step for every window up to `decode_all`, then one token a step of window 0 alone to the end."""
    prefill: int = 48
    chunk: int = 8
    mid: int = 96  # chunks up to this position
    decode_all: int = 160

    def steps(self, length: int, windows: int) -> Iterator[tuple[list[int], int, int]]:
        """(windows fed, start, tokens each) per step."""
        everyone = list(range(windows))
        yield everyone, 0, self.prefill
        for start in range(self.prefill, self.mid, self.chunk):
            yield everyone, start, self.chunk
        for start in range(self.mid, self.decode_all):
            yield everyone, start, 1
        for start in range(self.decode_all, length):
            yield [0], start, 1


def kernel_config(kernels: str) -> CpuKernelConfig:
    """The CpuKernelConfig of a kernel set (see the module's doc)."""
    if kernels == "shipped":
        return CpuKernelConfig()
    if kernels in ("w4a8", "w8a8"):
        return CpuKernelConfig(max_w4a8_rows=1 << 30, max_w8a8_rows=1 << 30, max_int8_rows=1 << 30)
    if kernels == "floor":  # the reference's own math: F.linear in bf16 on the dequantised weights
        return CpuKernelConfig(linear_fp32=False)
    if kernels in GEMMS or kernels == "floor32":
        return CpuKernelConfig()
    raise ValueError(f"unknown kernel set {kernels!r}: shipped, w4a8, w8a8, {', '.join(GEMMS)}, floor or floor32")


def forced_backend(kernels: str) -> CpuKernelBackend:
    """The backend of a kernel set; `w4a8` / `w8a8` take their kernels whether or not this CPU has VNNI."""
    backend = CpuKernelBackend(kernel_config(kernels))
    if kernels == "shipped":
        return backend
    if kernels in GEMMS:
        cap = backend.config.row_caps()[kernels]
        table = dataclasses.replace(backend.dispatch, **{GEMMS[kernels]: Route.from_rule(
            lambda rows: kernels if rows <= cap else "linear", (cap,))})
    elif kernels in ("floor", "floor32"):
        linear, memoised = ("linear", MemoisedFloor) if kernels == "floor" else ("linear32", MemoisedFloor32)
        table = dataclasses.replace(backend.dispatch, **{fmt: Route.only(linear) for fmt in DISPATCH_FORMATS})
        return memoised(dataclasses.replace(backend.config, dispatch=table))
    else:
        table = dataclasses.replace(backend.dispatch, int8=Route.only("w8a8"), int4=Route.only("w4a8"))
    return CpuKernelBackend(dataclasses.replace(backend.config, dispatch=table))


class MemoisedReference(TorchBackend):
    """The reference path (TorchBackend) keeping each quantised weight's dequantised chunks, and the LM head's
    fp32 ones: the same ops on the same values, so the same bits, without dequantising or widening every weight
    again at every step (which made the reference of Gemma 3's 262k-row head the slowest part of the gate)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.chunks: dict[tuple, torch.Tensor] = {}

    def kept(self, weight: torch.Tensor, x: torch.Tensor, dequantize_rows):
        """`dequantize_rows` of `weight` for x's dtype, each chunk made once."""
        def rows(begin: int, end: int) -> torch.Tensor:
            key = (id(weight), begin, end, x.dtype)
            if key not in self.chunks:
                self.chunks[key] = dequantize_rows(begin, end)
            return self.chunks[key]
        return rows

    def linear_int8(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        codes, scale = w.data, w.scale

        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return weight_ops.dequantize(codes[begin:end], scale[begin:end], x.dtype)
        return weight_ops.linear_int8(x, codes, scale, w.bias, self.kept(codes, x, dequantize_rows))

    def linear_int4(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return weight_ops.int4_rows(w.data, w.scale, torch.arange(begin, end), x.shape[-1], x.dtype)
        return weight_ops.linear_int4(x, w.data, w.scale, w.bias, self.kept(w.data, x, dequantize_rows))

    def linear_int8g(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        def dequantize_rows(begin: int, end: int) -> torch.Tensor:
            return weight_ops.int8g_rows(w.data, w.scale, slice(begin, end), x.shape[-1], x.dtype)
        return weight_ops.linear_int8g(x, w.data, w.scale, w.bias, self.kept(w.data, x, dequantize_rows))

    def lm_head(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        rows = weight_ops.weight_rows_fp32(w.data, w.scale, x.shape[-1])
        return weight_ops.linear_fp32(x, w.data, w.scale, self.kept(w.data, x.float(), rows))


class MemoisedFloor(CpuKernelBackend):
    """The `floor` set: this CPU's kernels with every quantised product on the "linear" route, whose F.linear on
    the weight dequantised by the kernels' dequantisers has the reference's bits; so the products run the memoised
    reference's (dequantising every weight at every step made the floor the slowest set of the gate)."""

    def __init__(self, config: CpuKernelConfig) -> None:
        super().__init__(config)
        self.reference = MemoisedReference()

    def linear_int8(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self.reference.linear_int8(x, w)

    def linear_int4(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self.reference.linear_int4(x, w)

    def linear_int8g(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self.reference.linear_int8g(x, w)

    def lm_head(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return super().lm_head(x, w) if w.scale is None else self.reference.lm_head(x, w)


class MemoisedFloor32(CpuKernelBackend):
    """The `floor32` set: this CPU's kernels with every product on the "linear32" route (F.linear in fp32 on the
    weights widened or dequantised to fp32, exactly), the LM head's as the reference's; the fp32 chunks kept."""

    def __init__(self, config: CpuKernelConfig) -> None:
        super().__init__(config)
        self.reference = MemoisedReference()

    def _rows_fp32(self, w: Weight, x: torch.Tensor):
        rows = super()._rows_fp32(w, x) or weight_ops.weight_rows_fp32(w.data, w.scale, x.shape[-1])
        return self.reference.kept(w.data, x.float(), rows)

    def lm_head(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self.reference.lm_head(x, w)


def load(source: ModelSource, weight_dtype: str) -> LlamaModel:
    return load_model(source, torch.bfloat16, weight_dtype=weight_dtype)


def forced_logits(model: LlamaModel, windows: list[list[int]], schedule: Schedule,
                  use_kernels: bool) -> Iterator[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """Per step of `schedule`: the logits [rows, V] fp32 and each row's (window, position)."""
    length = len(windows[0])
    per_window = -(-length // BLOCK_SIZE)
    layers = KVCache(model.cfg, len(windows) * per_window, BLOCK_SIZE, torch.bfloat16).layers
    tables = [list(range(i * per_window, (i + 1) * per_window)) for i in range(len(windows))]
    for fed, start, count in schedule.steps(length, len(windows)):
        if count == 1 and start > 0:
            meta = AttentionMetadata.build(BLOCK_SIZE, [(tables[w], start + 1) for w in fed], [], use_kernels)
        else:
            meta = AttentionMetadata.build(BLOCK_SIZE, [], [(tables[w], start, count) for w in fed], use_kernels)
        ids = torch.tensor([t for w in fed for t in windows[w][start:start + count]])
        positions = torch.arange(start, start + count).repeat(len(fed))
        hidden = model(ids, positions, meta, layers)
        yield model.compute_logits(hidden), [(w, p) for w in fed for p in range(start, start + count)]


def scored_steps(model: LlamaModel, windows: list[list[int]], schedule: Schedule,
                 use_kernels: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: the logits of the positions that have a next token in their window, and those next tokens."""
    for logits, rows in forced_logits(model, windows, schedule, use_kernels):
        keep = [i for i, (w, p) in enumerate(rows) if p < len(windows[w]) - 1]
        yield logits[keep], torch.tensor([windows[w][p + 1] for w, p in (rows[i] for i in keep)])


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step (ulp) at each value of x: 2^(exponent - 7)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def top1_ties(ref: torch.Tensor, got: torch.Tensor) -> int:
    """Rows whose candidate's first choice the reference scores within one bf16 step of its own best: the hidden
    state the LM head reads is bf16, so candidates that close are ordered by rounding."""
    best = ref.max(-1).values
    chosen = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    return int((chosen >= best - bf16_step(best)).sum())


@torch.inference_mode()
def reference_logits(model: LlamaModel, windows: list[list[int]], schedule: Schedule) -> list[torch.Tensor]:
    """The reference path's scored logits per step (switches `model` to it)."""
    model.set_backend(MemoisedReference())
    try:
        return [logits for logits, _ in scored_steps(model, windows, schedule, False)]
    finally:
        model.set_backend(TorchBackend("cpu"))  # drops the dequantised copies


@torch.inference_mode()
def compare(reference: list[torch.Tensor], model: LlamaModel, backend: Backend, windows: list[list[int]],
            schedule: Schedule = Schedule()) -> dict:
    """Teacher-forced scores of `model` on `backend` against the reference's logits of the same schedule, over
    every position but each window's last: Scores' figures (top1: strict argmax agreement), and top1_ties:
    agreement up to one bf16 step (the gate's)."""
    scores, ties = Scores(), 0
    model.set_backend(backend)
    for ref, (got, targets) in zip(reference, scored_steps(model, windows, schedule, True), strict=True):
        scores.add(ref.log_softmax(-1), got.log_softmax(-1), targets)
        ties += top1_ties(ref, got)
    return scores.summary() | {"top1_ties": ties / scores.count}


class Gate:
    """One weight format of one model, loaded once, and its reference's logits: every kernel set asked of it runs
    the same weights, one backend after another, and is scored against the same logits."""

    def __init__(self, source: ModelSource, weight_dtype: str, windows: list[list[int]],
                 schedule: Schedule = Schedule()) -> None:
        self.model = load(source, weight_dtype)
        self.windows, self.schedule = windows, schedule
        self.reference = reference_logits(self.model, windows, schedule)

    def score(self, kernels: str) -> dict:
        """The scores of one kernel set, with the kernels that ran and what the format resolved to."""
        backend = forced_backend(kernels)
        return compare(self.reference, self.model, backend, self.windows, self.schedule) | {
            "kernels": backend.kernels(), "weights": self.model.weight_dtype,
            "head": "quantised" if self.model.lm_scale() is not None else "bf16"}


def gate(source: ModelSource, weight_dtype: str, kernel_sets: list[str], windows: list[list[int]],
         schedule: Schedule = Schedule()) -> dict[str, dict]:
    """Per kernel set: the scores of one format (Gate.score)."""
    one_format = Gate(source, weight_dtype, windows, schedule)
    return {kernels: one_format.score(kernels) for kernels in kernel_sets}


def text_windows(source: ModelSource, windows: int, length: int) -> list[list[int]]:
    return corpus_windows(source.tokenizer, length, windows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: SmolLM2-135M)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--kernels", default="shipped",
                        help=f"comma-separated: shipped, w4a8, w8a8, {', '.join(GEMMS)}, floor, floor32")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model or default_model_path())
    windows = text_windows(source, args.windows, args.length)
    results = {}
    print(f"{'format':9} {'kernels':8} {'weights':8} {'head':9} {'positions':>9} {'top-1':>7} {'ties':>7} {'KL mean':>9} "
          f"{'KL p99':>8} {'KL max':>8}")
    for weight_dtype in args.formats.split(","):
        for kernels, r in gate(source, weight_dtype, args.kernels.split(","), windows).items():
            results[f"{weight_dtype}/{kernels}"] = r
            print(f"{weight_dtype:9} {kernels:8} {r['weights']:8} {r['head']:9} {r['tokens']:9d} {r['top1']:7.4f} {r['top1_ties']:7.4f} "
                  f"{r['kl_mean']:9.5f} {r['kl_p99']:8.5f} {r['kl_max']:8.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
