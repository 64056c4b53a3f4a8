"""Offline throughput: our engine (`LLM.generate`) against Hugging Face `generate` on the same model and prompts.

    python -m bench.offline_throughput [--batch-sizes 1,8,32,64] [--input-len 128] [--output-len 128]
        [--threads 2] [--dtype bfloat16] [--model PATH] [--skip-hf] [--json OUT]
        [--rounds 1] [--profile] [--profile-batch 64] [--profile-steps 20]

For each batch size B, both run B distinct token-id prompts of exactly --input-len tokens (rotated English text
with a numbered header, so that the prefix cache cannot skip prefill) and produce exactly --output-len tokens each
(greedy, EOS ignored). Output tokens/s is total output tokens / wall time of the whole batch, prefill included;
a second table splits each run into its prefill phase (ours: the last first token; HF: its first call of a
logits processor that leaves the scores alone) and the decode steps after it. Our engine runs with LLM's default
step budget (--max-num-batched-tokens to change it).
--rounds N alternates the two N times per batch (fresh prompts each round) and reports the median run of each
side and the median of the per-round ratios: on a shared host the HF side alone has swung by 30-50%.
The batch-1 decode rate (1 / TPOT) is compared with the memory-bandwidth bound: bytes of weights read per decode
step / copy bandwidth measured in the same run. --profile runs decode steps under torch.profiler.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch

from bench.provenance import provenance
from engine import LLM, EngineConfig, ModelConfig, SamplingParams
from engine.core.engine_core import EngineRequest
from engine.backends import CpuKernelBackend
from engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS
from engine.kv.cache import bytes_per_block
from engine.model.loader import resolve_model
from engine.core.output_processor import OutputProcessor
from engine.model.tokenizer import Tokenizer

# Prompt material: plain English, rotated per prompt. Written for this benchmark.
TEXT = """\
The lighthouse at the end of the harbour was built in the spring of a year that nobody in the village could \
agree on. Some said it was the year of the great storm, when the fishing boats were thrown onto the rocks and \
the church bell rang for three days; others said it came later, after the railway reached the valley and \
brought engineers who measured everything twice. What everyone agreed on was the keeper. She climbed the \
ninety-two steps every evening before sunset, trimmed the wick, polished the brass and wrote the weather in a \
ledger bound in green cloth. Her entries were short: wind from the west, sea moderate, two steamers passing \
north, a gull with a broken wing on the gallery rail.

In winter the work was harder. Ice formed on the outside of the lantern glass and had to be scraped away with \
a wooden paddle, because metal would scratch the panes. The oil thickened in the cold, and the clockwork that \
turned the lens had to be wound every four hours through the night. She kept a kettle on the small stove in \
the service room and slept in short pieces, waking before the weights reached the bottom of their shaft. When \
fog came in from the sea she started the horn, a compressed-air engine that shook the tower and could be \
heard, the fishermen claimed, halfway to the islands.

Children from the school visited once a year. They were allowed to look through the lens from the inside, \
where the light bent into long ribbons and the harbour seemed to float upside down. The keeper explained how \
each lighthouse along the coast flashed its own pattern, so that a navigator could count the seconds between \
flashes and know exactly which headland lay ahead. Two short and one long meant home. The children counted \
aloud, got it wrong, and counted again, and on the walk back down the steps they argued about whether the \
light could be seen from the moon.

Years later, when the light was automated and the keeper's cottage became a small museum, the green ledgers \
were put in a glass case near the door. Visitors read the weather of forgotten days and the names of ships \
that no longer sailed. A retired engineer who came every summer liked to point out that the handwriting never \
changed, not in forty years, not even on the night of the great storm, whichever year that had really been.
"""
HEADER = "Passage {index}. "
ROTATION_STRIDE = 37  # tokens between the start offsets of consecutive prompts


# ---------------------------------------------------------------------------------------------------- prompts

class PromptFactory:
    """Distinct token-id prompts of an exact length: a numbered header, then the text rotated per prompt."""

    def __init__(self, tokenizer: Tokenizer, input_len: int) -> None:
        self.tokenizer = tokenizer
        self.input_len = input_len
        self.stream = tokenizer.encode(TEXT, add_special_tokens=False)
        self.next_index = 0

    def make(self, count: int) -> list[list[int]]:
        prompts = [self._prompt(self.next_index + i) for i in range(count)]
        self.next_index += count
        return prompts

    def _prompt(self, index: int) -> list[int]:
        header = self.tokenizer.encode(HEADER.format(index=index), add_special_tokens=False)
        need = max(self.input_len - len(header), 0)
        start = (index * ROTATION_STRIDE) % len(self.stream)
        repeats = (start + need) // len(self.stream) + 1
        body = (self.stream * repeats)[start:start + need]
        return (header + body)[: self.input_len]


# ---------------------------------------------------------------------------------------------------- results

@dataclass
class OursResult:
    batch: int
    wall_s: float = math.nan
    tokens_per_s: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    ttft_max_ms: float = math.nan  # the last first token: every prompt is prefilled by then
    others_cpu: float = math.nan  # share of all cores used by other processes during the run
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    round_rates: list[tuple[float, float]] = field(default_factory=list)  # (ours, HF) tokens/s of each round


@dataclass
class HFResult:
    batch: int
    wall_s: float = math.nan
    tokens_per_s: float = math.nan
    prefill_s: float = math.nan  # generate() start to its first logits processor call (the batch's prefill)
    others_cpu: float = math.nan
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class CpuSample:
    busy_s: float  # CPU time of the whole machine
    own_s: float  # CPU time of this process
    at: float


@dataclass(frozen=True)
class Agreement:
    first_token_matches: int
    mean_common_prefix: float
    full_matches: int


@dataclass(frozen=True)
class Bandwidth:
    best_gb_s: float
    median_gb_s: float
    tensor_mib: int


# ---------------------------------------------------------------------------------------------------- helpers

def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else math.nan


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_sample() -> CpuSample:
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already counted in user/nice
    own = psutil.Process().cpu_times()
    return CpuSample(sum(t) - idle - guest, own.user + own.system, time.monotonic())


def wait_for_quiet(threshold: float, max_wait_s: float, window_s: float = 5.0) -> None:
    """Wait (at most max_wait_s) until other processes use at most `threshold` of the cores over a window."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        before = cpu_sample()
        time.sleep(window_s)
        share = others_cpu_share(before, cpu_sample())
        if share <= threshold:
            return
        log(f"  waiting for a quiet machine: other processes use {share:.0%} of the cores")


def others_cpu_share(before: CpuSample, after: CpuSample) -> float:
    """Share of all cores that other processes used between the two samples (0 = we ran alone)."""
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others) / max((after.at - before.at) * (os.cpu_count() or 1), 1e-9)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure_copy_bandwidth(mib: int = 512, repeats: int = 5) -> Bandwidth:
    """GB/s of `dst.copy_(src)` on a bf16 tensor, counting read + write (2 x bytes per copy)."""
    src = torch.ones(mib * (1 << 20) // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _bandwidth(lambda: dst.copy_(src), 2 * mib * (1 << 20), repeats, mib)


def measure_read_bandwidth(mib: int = 256, repeats: int = 3) -> Bandwidth:
    """GB/s of `torch.sum` over an int64 tensor: a read-only stream, as a batch-1 decode step reads its weights (a
    copy also writes; on a shared host the two rates need not move together)."""
    src = torch.ones(mib * (1 << 20) // 8, dtype=torch.int64)
    return _bandwidth(src.sum, mib * (1 << 20), repeats, mib)


def _bandwidth(run, nbytes: int, repeats: int, mib: int) -> Bandwidth:
    """GB/s of `run()` moving `nbytes`, over `repeats` timed calls after one that touches the pages."""
    run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return Bandwidth(max(rates), float(np.median(rates)), mib)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes read per decode step. A tied embedding counts once (as the LM head); an untied
    embedding's lookup reads a few rows only, so it is left out."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        embed = model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Agreement:
    prefixes = [_common_prefix(a, b) for a, b in zip(ours, theirs)]
    first = sum(1 for a, b in zip(ours, theirs) if a[:1] == b[:1])
    full = sum(1 for a, b in zip(ours, theirs) if a == b)
    return Agreement(first, float(np.mean(prefixes)) if prefixes else math.nan, full)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------------- our engine

def kv_cache_bytes(config: ModelConfig, dtype: torch.dtype, block_size: int, sequences: list[tuple[int, int]]) -> int:
    """Enough KV for the largest of the (batch, tokens per sequence) workloads, with a quarter spare."""
    blocks = max(batch * -(-tokens // block_size) for batch, tokens in sequences)
    return int(blocks * bytes_per_block(config, block_size, dtype) * 1.25) + (16 << 20)


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "auto" else getattr(torch, name)


def build_engine(args: argparse.Namespace, max_batch: int) -> LLM:
    workloads = [(max(args.batch_list, default=1), args.input_len + args.output_len)]
    if args.profile:
        workloads.append((args.profile_batch, args.input_len + profile_output_len(args.profile_steps)))
    config = resolve_model(args.model).config  # reads the checkpoint's config (a GGUF is read whole: ~1 s)
    kv_bytes = kv_cache_bytes(config, _dtype(args.dtype), EngineConfig().block_size, workloads)
    return LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=max(max_batch, 1),
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=kv_bytes)


PROFILE_PREFILL_ALLOWANCE = 256  # steps the profiled batch may spend in prefill before decode-only steps


def profile_output_len(steps: int) -> int:
    """Output tokens a profiled request asks for: enough that none finishes during the prefill allowance, the
    settling steps and the plain and profiled steps (the requests are aborted afterwards)."""
    return PROFILE_PREFILL_ALLOWANCE + 2 * steps + 8


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> OursResult:
    result = OursResult(batch=len(prompts))
    cpu_before, start = cpu_sample(), time.perf_counter()
    outs = llm.generate(prompts, greedy(output_len))
    result.wall_s = time.perf_counter() - start
    result.others_cpu = others_cpu_share(cpu_before, cpu_sample())
    result.outputs = [list(o.token_ids) for o in outs]
    bad = [i for i, o in enumerate(outs) if len(o.token_ids) != output_len]
    if bad:
        result.error = (f"{len(bad)} of {len(outs)} outputs do not have {output_len} tokens "
                        f"(e.g. #{bad[0]}: {len(outs[bad[0]].token_ids)} tokens, "
                        f"finish_reason={outs[bad[0]].finish_reason!r})")
    result.tokens_per_s = sum(len(o.token_ids) for o in outs) / result.wall_s
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    result.ttft_p50_ms, result.ttft_p99_ms = percentile_ms(ttfts, 50), percentile_ms(ttfts, 99)
    result.ttft_max_ms = max(ttfts, default=math.nan) * 1000
    result.tpot_p50_ms, result.tpot_p99_ms = percentile_ms(tpots, 50), percentile_ms(tpots, 99)
    return result


# ---------------------------------------------------------------------------------------------------- Hugging Face

def load_hf_model(model: str | None, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from engine.model.gguf_loader import default_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = default_model_path() if model is None else Path(model).expanduser()
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF de-quantisation progress bar
        if path.is_file() and path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                      attn_implementation="sdpa")
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return hf.eval()


def describe_hf(hf: torch.nn.Module) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in hf.parameters()})
    linear = sum(1 for m in hf.modules() if type(m) is torch.nn.Linear)
    params = sum(p.numel() for p in hf.parameters())
    return (f"{type(hf).__name__}, attention={hf.config._attn_implementation}, {params / 1e6:.1f}M parameters "
            f"({', '.join(dtypes)}), {linear} dense nn.Linear layers")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_pad_id(hf: torch.nn.Module) -> int:
    gen = hf.generation_config
    for candidate in (gen.pad_token_id, gen.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def first_call_clock():
    """A logits processor that leaves the scores alone and notes when generate() first calls it: the end of
    the prefill forward."""
    from transformers import LogitsProcessor

    class FirstCallClock(LogitsProcessor):
        first = math.nan

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if math.isnan(self.first):
                self.first = time.perf_counter()
            return scores

    return FirstCallClock()


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], output_len: int, threads: int) -> HFResult:
    torch.set_num_threads(threads)
    result = HFResult(batch=len(prompts))
    pad_id = hf_pad_id(hf)
    ids, mask = left_pad(prompts, pad_id)
    clock = first_call_clock()
    cpu_before, start = cpu_sample(), time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                          min_new_tokens=output_len, pad_token_id=pad_id, logits_processor=[clock])
    result.wall_s = time.perf_counter() - start
    result.prefill_s = clock.first - start
    result.others_cpu = others_cpu_share(cpu_before, cpu_sample())
    result.outputs = out[:, ids.shape[1]:].tolist()
    result.tokens_per_s = sum(len(o) for o in result.outputs) / result.wall_s
    return result


# ---------------------------------------------------------------------------------------------------- profile

# Phases of EngineCore.step() timed by wrapping these methods of the engine's objects while profiling.
ENGINE_PHASES = {"schedule": ("scheduler", "schedule"), "runner.run": ("runner", "run"),
                 "scheduler.update": ("scheduler", "update")}
PHASES = (*ENGINE_PHASES, "rest of engine.step", "output_processor")


@dataclass
class StepTimes:
    wall: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def add_requests(llm: LLM, processor: OutputProcessor, prompts: list[list[int]], params: SamplingParams,
                 tag: str) -> list[str]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        processor.add(rid, None, prompt, params)
        llm.engine.add_request(EngineRequest(rid, prompt, params, arrival_time=time.monotonic()))
    return ids


def _timed(fn, name: str, times: StepTimes, annotate: bool):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        with torch.profiler.record_function(f"bench::{name}") if annotate else contextlib.nullcontext():
            value = fn(*args, **kwargs)
        times.phases[name] += time.perf_counter() - start
        return value
    return wrapper


@contextlib.contextmanager
def timed_phases(llm: LLM, times: StepTimes, annotate: bool):
    """Wrap the engine's phase methods (instance attributes shadowing the class's) and remove the wrappers after."""
    owners = []
    for name, (owner_attr, method) in ENGINE_PHASES.items():
        owner = getattr(llm.engine, owner_attr)
        if method in vars(owner):
            raise RuntimeError(f"{owner_attr}.{method} is already wrapped")
        setattr(owner, method, _timed(getattr(owner, method), name, times, annotate))
        owners.append((owner, method))
    try:
        yield
    finally:
        for owner, method in owners:
            delattr(owner, method)


def engine_step(llm: LLM, processor: OutputProcessor, times: StepTimes, annotate: bool) -> None:
    """One EngineCore.step() with its phases timed, then the front end's output processing (as LLM.generate)."""
    start = time.perf_counter()
    before = sum(times.phases[name] for name in ENGINE_PHASES)
    with timed_phases(llm, times, annotate):
        updates = _timed(llm.engine.step, "rest of engine.step", times, annotate)()
    inner = sum(times.phases[name] for name in ENGINE_PHASES) - before
    times.phases["rest of engine.step"] -= inner  # the step's time outside the three wrapped phases
    _, to_abort = _timed(processor.process, "output_processor", times, annotate)(updates)
    for rid, index in to_abort:
        llm.engine.abort_request(rid, index)
    times.wall.append(time.perf_counter() - start)


@contextlib.contextmanager
def annotated_kernels(llm: LLM):
    """Our C++ kernels are torch operators (phase_serve::*), which the profiler times as ops; the decode stack (all
    layers of a decode-only step in one pybind call) is not: while profiling, each call of it is wrapped in a
    record_function named cpu_ext::decode_stack, which the summary counts as an op. Its self time is our kernels
    inside it (the packed products included); the oneDNN products it dispatches show as their own ops."""
    def annotate(fn, name: str):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(f"cpu_ext::{name}"):
                return fn(*args, **kwargs)
        return wrapper

    if not isinstance(llm.engine.runner.backend, CpuKernelBackend):  # plain torch ops: nothing to annotate
        yield
        return
    run_stack = CpuKernelBackend.decode_layers
    CpuKernelBackend.decode_layers = annotate(run_stack, "decode_stack")
    try:
        yield
    finally:
        CpuKernelBackend.decode_layers = run_stack


def all_decoding(llm: LLM) -> bool:
    sched = llm.engine.scheduler
    return not sched.waiting and all(seq.prefill_done for seq in sched.running)


def profile_decode(llm: LLM, factory: PromptFactory, batch: int, steps: int, top: int,
                   python_layers: bool = False) -> dict:
    """Prefill `batch` prompts, then time `steps` decode steps plainly and `steps` more under torch.profiler.
    python_layers: the layers run from Python (the decode stack off), so that each kernel shows by itself."""
    with decode_stack(llm, not python_layers):
        return profile_steps(llm, factory, batch, steps, top)


@contextlib.contextmanager
def decode_stack(llm: LLM, on: bool):
    """The engine's kernel backend with its decode stack on or off, then the engine's own backend again."""
    runner = llm.engine.runner
    saved = runner.backend
    if isinstance(saved, CpuKernelBackend) and saved.config.decode_stack != on:
        runner.set_backend(CpuKernelBackend(dataclasses.replace(saved.config, decode_stack=on)))
    try:
        yield
    finally:
        if runner.backend is not saved:
            runner.set_backend(saved)


def profile_steps(llm: LLM, factory: PromptFactory, batch: int, steps: int, top: int) -> dict:
    processor = OutputProcessor(llm.tokenizer)
    params = greedy(profile_output_len(steps))
    ids = add_requests(llm, processor, factory.make(batch), params, "profile")
    scratch = StepTimes()
    while not all_decoding(llm):
        if len(scratch.wall) >= PROFILE_PREFILL_ALLOWANCE:
            raise RuntimeError(f"batch {batch} still prefilling after {len(scratch.wall)} steps")
        engine_step(llm, processor, scratch, annotate=False)
    prefill_steps = len(scratch.wall)
    for _ in range(3):  # settle
        engine_step(llm, processor, scratch, annotate=False)
    plain, cpu_before = StepTimes(), cpu_sample()
    for _ in range(steps):
        engine_step(llm, processor, plain, annotate=False)
    others = others_cpu_share(cpu_before, cpu_sample())
    profiled = StepTimes()
    with annotated_kernels(llm), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine_step(llm, processor, profiled, annotate=True)
    running = len(llm.engine.scheduler.running)
    for rid in ids:
        llm.engine.abort_request(rid)
    summary = summarise_profile(prof, plain, profiled, batch, running, steps, top)
    summary["others_cpu_plain"] = others
    summary["prefill_steps"] = prefill_steps
    return summary


def summarise_profile(prof, plain: StepTimes, profiled: StepTimes, batch: int, running: int, steps: int,
                      top: int) -> dict:
    events = prof.key_averages()
    ops = [e for e in events if not e.key.startswith("bench::")]
    annotations = {e.key.removeprefix("bench::"): e for e in events if e.key.startswith("bench::")}
    op_self_us = sum(e.self_cpu_time_total for e in ops)
    prof_wall_us = sum(profiled.wall) * 1e6
    plain_wall_us = sum(plain.wall) * 1e6
    ranked = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "batch": batch,
        "running": running,
        "steps": steps,
        "plain_step_ms": plain_wall_us / steps / 1000,
        "profiled_step_ms": prof_wall_us / steps / 1000,
        "op_self_ms_per_step": op_self_us / steps / 1000,
        "op_calls_per_step": sum(e.count for e in ops) / steps,
        "outside_ops_share_profiled": 1 - op_self_us / prof_wall_us,
        "outside_ops_share_plain_estimate": max(0.0, 1 - op_self_us / plain_wall_us),
        "phases_ms_per_step": {k: v / steps * 1000 for k, v in plain.phases.items()},
        "phase_python_ms_per_step": {k: a.self_cpu_time_total / steps / 1000 for k, a in annotations.items()},
        "top_ops": [{"op": e.key, "calls_per_step": e.count / steps,
                     "self_ms_per_step": e.self_cpu_time_total / steps / 1000,
                     "share_of_step": e.self_cpu_time_total / prof_wall_us} for e in ranked],
        "method": ("torch.profiler (CPU activity): outside-ops time = wall time of the profiled steps minus the sum "
                   "of self CPU time of all torch ops and of our C++ kernels (phase_serve::*, cpu_ext::decode_stack; the phase annotations "
                   "excluded); py-spy "
                   + ("is installed but was not used (see bench/decode_loop.py)" if py_spy_installed()
                      else "is not installed")),
    }


def py_spy_installed() -> bool:
    """On PATH, or beside this interpreter (a virtual environment run without activating it)."""
    return bool(shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent)))


def print_profile(summary: dict) -> None:
    s = summary
    print(f"\nProfile: batch {s['batch']} ({s['running']} running at the end; prefill took {s['prefill_steps']} "
          f"steps), {s['steps']} decode steps plain, then {s['steps']} under the profiler")
    print(f"  method: {s['method']}")
    print(f"  step wall time: {s['plain_step_ms']:.1f} ms plain, {s['profiled_step_ms']:.1f} ms under the profiler "
          f"({s['op_calls_per_step']:.0f} torch op calls per step; other processes used "
          f"{s['others_cpu_plain']:.0%} of the cores during the plain steps)")
    print(f"  self CPU time in torch ops: {s['op_self_ms_per_step']:.1f} ms per step")
    print(f"  time outside torch ops (Python overhead): {s['outside_ops_share_profiled']:.1%} of profiled step time; "
          f"against the plain step time {s['outside_ops_share_plain_estimate']:.1%} (a lower bound: the profiler "
          f"inflates the ops' own times too)")
    print("  phases (plain steps, ms per step; 'python' = time in the phase outside torch ops, from the profiler):")
    for name, ms in s["phases_ms_per_step"].items():
        py = s["phase_python_ms_per_step"].get(name, math.nan)
        print(f"    {name:<18} {ms:8.2f} ms   python {py:7.2f} ms")
    print(f"  top {len(s['top_ops'])} ops by self CPU time:")
    print(f"    {'op':<44} {'calls/step':>10} {'self ms/step':>13} {'% of step':>10}")
    for row in s["top_ops"]:
        print(f"    {row['op'][:44]:<44} {row['calls_per_step']:10.1f} {row['self_ms_per_step']:13.2f} "
              f"{row['share_of_step']:10.1%}")


# ---------------------------------------------------------------------------------------------------- report

def fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(ours: list[OursResult], hf: dict[int, HFResult], agree: dict[int, Agreement],
                output_len: int) -> None:
    head = (f"{'batch':>5} {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'TPOT p99':>9} {'ours s':>7} {'HF s':>7} {'others':>11}  agreement with HF")
    print(head)
    print(f"{'':>5} {'':>10} {'':>9} {'':>6} {'ms':>9} {'ms':>9} {'ms':>9} {'ms':>9} {'':>7} {'':>7} "
          f"{'ours/HF':>11}")
    for r in ours:
        h = hf.get(r.batch)
        ratio = r.tokens_per_s / h.tokens_per_s if h and h.tokens_per_s == h.tokens_per_s else math.nan
        if len(r.round_rates) > 1:
            ratio = float(np.median([a / b for a, b in r.round_rates]))
        a = agree.get(r.batch)
        agree_text = (f"first token {a.first_token_matches}/{r.batch}, identical {a.full_matches}/{r.batch}, "
                      f"mean common prefix {a.mean_common_prefix:.1f}/{output_len}") if a else ""
        print(f"{r.batch:>5} {fmt(r.tokens_per_s, '.1f'):>10} {fmt(h.tokens_per_s if h else math.nan, '.1f'):>9} "
              f"{fmt(ratio, '.2f'):>6} {fmt(r.ttft_p50_ms, '.0f'):>9} {fmt(r.ttft_p99_ms, '.0f'):>9} "
              f"{fmt(r.tpot_p50_ms, '.1f'):>9} {fmt(r.tpot_p99_ms, '.1f'):>9} {fmt(r.wall_s, '.1f'):>7} "
              f"{fmt(h.wall_s if h else math.nan, '.1f'):>7} {others_text(r, h):>11}  {agree_text}")
        for err in (r.error, h.error if h else None):
            if err:
                print(f"      ERROR: {err}")


def print_phases(ours: list[OursResult], hf: dict[int, HFResult], output_len: int) -> None:
    """Each side's run split into its prefill phase (ours: the last first token; HF: its first logits) and the
    decode phase after it, per decode step, for the runs in the table (no decode phase with one output token)."""
    if output_len < 2:
        return
    print("\nphases of the runs above: prefill (s) = until every prompt has its first token; decode = the rest "
          f"/ {output_len - 1} steps")
    print(f"{'batch':>5} {'ours prefill':>12} {'HF prefill':>10} {'ratio':>6} {'ours decode':>11} {'HF decode':>9} "
          f"{'ratio':>6}")
    for r in ours:
        h = hf.get(r.batch)
        if h is None or math.isnan(r.ttft_max_ms) or math.isnan(h.prefill_s):
            continue
        ours_decode = (r.wall_s * 1000 - r.ttft_max_ms) / (output_len - 1)
        hf_decode = (h.wall_s - h.prefill_s) * 1000 / (output_len - 1)
        prefill_s = r.ttft_max_ms / 1000
        print(f"{r.batch:>5} {prefill_s:>11.2f}s {h.prefill_s:>9.2f}s {h.prefill_s / prefill_s:>5.2f}x "
              f"{ours_decode:>9.1f}ms {hf_decode:>7.1f}ms {hf_decode / ours_decode:>5.2f}x")


def others_text(r: OursResult, h: HFResult | None) -> str:
    return f"{fmt(r.others_cpu * 100, '.0f')}%/{fmt(h.others_cpu * 100, '.0f') if h else '-'}%"


def print_notes(ours: list[OursResult], hf: dict[int, HFResult]) -> None:
    for r in ours:
        if len(r.round_rates) > 1:
            pairs = ", ".join(f"{a:.1f}/{b:.1f}={a / b:.2f}x" for a, b in r.round_rates)
            print(f"B={r.batch} rounds (ours/HF tok/s): {pairs}; the table shows the median run of each side and "
                  f"the median of the rounds' ratios")
    print("others = share of all cores used by other processes during the run (psutil; 0% = we ran alone)")
    busiest = max([r.others_cpu for r in ours] + [h.others_cpu for h in hf.values()] + [0.0])
    if busiest > 0.10:
        print(f"WARNING: other processes used up to {busiest:.0%} of the cores during a run; with "
              f"{torch.get_num_threads()} OpenMP threads on {os.cpu_count()} cores those rows are not reliable.")


def print_bound(ours: list[OursResult], weight_bytes: int, bw: Bandwidth) -> dict:
    bound = bw.best_gb_s * 1e9 / weight_bytes
    print(f"\nMemory-bandwidth bound (batch 1): weights read per decode step {weight_bytes / 1e6:.1f} MB; "
          f"copy bandwidth (read+write, {bw.tensor_mib} MiB bf16 copy_) best {bw.best_gb_s:.1f} GB/s, "
          f"median {bw.median_gb_s:.1f} GB/s -> bound {bound:.1f} tokens/s")
    one = next((r for r in ours if r.batch == 1 and not math.isnan(r.tpot_p50_ms)), None)
    if one is None:
        print("  (no batch-1 run: the decode rate is not compared)")
        return {"bound_tokens_per_s": bound}
    rate = 1000.0 / one.tpot_p50_ms
    print(f"  batch-1 decode rate 1/TPOT p50 = {rate:.1f} tokens/s = {rate / bound:.0%} of the bound "
          f"(end-to-end incl. prefill: {one.tokens_per_s:.1f} tokens/s)")
    return {"bound_tokens_per_s": bound, "batch1_decode_tokens_per_s": rate, "fraction_of_bound": rate / bound}


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated; empty skips the table")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--model", default=None, help="HF folder or .gguf file; default: SmolLM2-135M GGUF")
    p.add_argument("--max-num-batched-tokens", type=int, default=OFFLINE_MAX_NUM_BATCHED_TOKENS,
                   help="our engine's step token budget (default: LLM's own)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternate ours and HF this many times at each batch; report medians")
    p.add_argument("--max-attempts", type=int, default=1,
                   help="repeat a run while other processes use more than --busy-threshold of the cores")
    p.add_argument("--busy-threshold", type=float, default=0.10)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to go under --busy-threshold")
    p.add_argument("--json", default=None, help="write all results to this file")
    p.add_argument("--profile", action="store_true", help="profile decode steps after the table")
    p.add_argument("--profile-batch", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--profile-python-layers", action="store_true",
                   help="profile with the decode stack off: each kernel's time by itself, at the Python layers' cost")
    args = p.parse_args(argv)
    args.batch_list = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.origin = provenance("offline_throughput", argv)  # taken when the run starts
    return args


def run_table(args: argparse.Namespace, llm: LLM, factory: PromptFactory
              ) -> tuple[list[OursResult], dict[int, HFResult], dict[int, Agreement], str | None]:
    hf_model, hf_desc = None, None
    if not args.skip_hf and args.batch_list:
        log("loading the Hugging Face model ...")
        hf_model = load_hf_model(args.model, _dtype(args.dtype))
        hf_desc = describe_hf(hf_model)
        run_hf(hf_model, factory.make(2), 4, args.threads)  # warm-up
    ours, hf, agree = [], {}, {}
    for batch in args.batch_list:
        rounds: list[tuple[OursResult, HFResult | None]] = []
        for _ in range(args.rounds):  # alternate, so that a slow spell of the machine hits both sides
            llm, prompts, result = quietest_ours(args, llm, factory, batch)
            rounds.append((result, None if hf_model is None else quietest_hf(args, hf_model, prompts)))
        first, first_hf = rounds[0]
        if first_hf is not None and first.outputs and first_hf.outputs:
            agree[batch] = agreement(first.outputs, first_hf.outputs)
        ours.append(median_run([r for r, _ in rounds]))
        if hf_model is not None:
            hf[batch] = median_run([h for _, h in rounds])
            ours[-1].round_rates = [(r.tokens_per_s, h.tokens_per_s) for r, h in rounds]
    return ours, hf, agree, hf_desc


def median_run(runs: list):
    """The run with the median throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.tokens_per_s)[(len(runs) - 1) // 2]


def quietest_ours(args: argparse.Namespace, llm: LLM, factory: PromptFactory, batch: int
                  ) -> tuple[LLM, list[list[int]], OursResult]:
    """Run up to --max-attempts times (fresh prompts each time: the prefix cache holds the earlier ones) until
    other processes stay under --busy-threshold; keep the quietest run."""
    best: tuple[list[list[int]], OursResult] | None = None
    for attempt in range(args.max_attempts):
        prompts = factory.make(batch)
        wait_for_quiet(args.busy_threshold, args.wait_quiet)
        result = safe_run_ours(llm, prompts, args.output_len)
        log(f"ours  B={batch} try {attempt + 1}: {result.tokens_per_s:.1f} tok/s in {result.wall_s:.1f} s, "
            f"others used {result.others_cpu:.0%} of the cores" + (f"  ERROR {result.error}" if result.error else ""))
        if result.error and not result.outputs:  # it raised: start from a fresh engine, report this run
            return build_engine(args, engine_max_batch(args)), prompts, result
        if best is None or result.others_cpu < best[1].others_cpu:
            best = (prompts, result)
        if result.error or result.others_cpu <= args.busy_threshold:
            break
    return (llm, *best)


def quietest_hf(args: argparse.Namespace, hf_model: torch.nn.Module, prompts: list[list[int]]) -> HFResult:
    best: HFResult | None = None
    for attempt in range(args.max_attempts):
        wait_for_quiet(args.busy_threshold, args.wait_quiet)
        result = safe_run_hf(hf_model, prompts, args.output_len, args.threads)
        log(f"HF    B={len(prompts)} try {attempt + 1}: {result.tokens_per_s:.1f} tok/s in {result.wall_s:.1f} s, "
            f"others used {result.others_cpu:.0%} of the cores" + (f"  ERROR {result.error}" if result.error else ""))
        if best is None or result.others_cpu < best.others_cpu:
            best = result
        if result.error or result.others_cpu <= args.busy_threshold:
            break
    return best


def engine_max_batch(args: argparse.Namespace) -> int:
    return max(args.batch_list + ([args.profile_batch] if args.profile else []) + [1])


def safe_run_ours(llm: LLM, prompts: list[list[int]], output_len: int) -> OursResult:
    try:
        return run_ours(llm, prompts, output_len)
    except Exception as exc:  # report and continue with the other batch sizes
        traceback.print_exc()
        return OursResult(batch=len(prompts), error=f"{type(exc).__name__}: {exc}")


def safe_run_hf(hf: torch.nn.Module, prompts: list[list[int]], output_len: int, threads: int) -> HFResult:
    try:
        return run_hf(hf, prompts, output_len, threads)
    except Exception as exc:
        traceback.print_exc()
        return HFResult(batch=len(prompts), error=f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    bw = measure_copy_bandwidth()
    log("loading our engine ...")
    llm = build_engine(args, engine_max_batch(args))
    factory = PromptFactory(llm.tokenizer, args.input_len)
    llm.generate(factory.make(2), greedy(16))  # warm-up
    print(f"model {llm.engine.source.name}, dtype {args.dtype}, input {args.input_len} tokens, "
          f"output {args.output_len} tokens, torch.get_num_threads() = {torch.get_num_threads()} "
          f"(--threads {args.threads}), cpu count {os.cpu_count()}, load average {load_average():.2f}, "
          f"max_num_seqs {llm.config.max_num_seqs}, max_num_batched_tokens {llm.config.max_num_batched_tokens}, "
          f"KV blocks {llm.engine.kv_cache.num_blocks}")
    ours, hf, agree, hf_desc = run_table(args, llm, factory)
    if hf_desc:
        print(f"HF: {hf_desc}; generate(do_sample=False, min_new_tokens=max_new_tokens={args.output_len}), "
              f"torch.get_num_threads() = {torch.get_num_threads()}")
    if args.batch_list:
        print()
        print_table(ours, hf, agree, args.output_len)
        print_notes(ours, hf)
        print_phases(ours, hf, args.output_len)
    bound = print_bound(ours, decode_weight_bytes(llm.engine.runner.model), bw)
    profile = None
    if args.profile:
        torch.set_num_threads(args.threads)
        wait_for_quiet(args.busy_threshold, args.wait_quiet)
        profile = profile_decode(llm, factory, args.profile_batch, args.profile_steps, args.profile_top,
                                 args.profile_python_layers)
        print_profile(profile)
    if args.json:
        write_json(args, ours, hf, agree, bw, bound, profile)


def write_json(args: argparse.Namespace, ours: list[OursResult], hf: dict[int, HFResult],
               agree: dict[int, Agreement], bw: Bandwidth, bound: dict, profile: dict | None) -> None:
    strip = lambda d: {k: v for k, v in d.items() if k != "outputs"}  # noqa: E731
    doc = {
        **args.origin,
        "args": {k: v for k, v in vars(args).items() if k != "origin"},
        "bandwidth": asdict(bw),
        "bound": bound,
        "ours": [strip(asdict(r)) for r in ours],
        "hf": {b: strip(asdict(r)) for b, r in hf.items()},
        "agreement": {b: asdict(a) for b, a in agree.items()},
        "profile": profile,
    }
    Path(args.json).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
