"""Start-up calibration: how long this engine takes to prefill n tokens and to run a decode step of B
sequences, measured on the real model so that placement decisions rest on numbers, not guesses.

Each curve must not fall as it grows (more tokens, or more sequences, never take less time). A timing that
does (a noisy core, a first call that paid for something) is a bad point: `monotonic_points` drops every point
that falls below an earlier one, the actor logs a warning naming them, and the router's cost model fits only
the points that remain.

An actor measures only when neither its predecessor (a restarted actor's spec) nor the on-disk cache holds the
curves for its model, machine and options (engine/core/calibration_store.py); otherwise it runs `warm_up`
(`warm_up_prefill`) instead."""
from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from engine.core.engine_core import EngineCore, EngineRequest
from engine.kv.cache import KVCache
from engine.core.prefill_engine import PrefillEngine, PrefillJob
from engine.model.progress import CALIBRATING, WARMING_UP, Progress, counted, report
from engine.sampling.sampling_params import SamplingParams

PREFILL_LENGTHS = (32, 128, 384)
DECODE_BATCHES = (1, 4, 16)
DECODE_STEPS = 4
PROCEDURE = 1  # raise it when the way a point is measured changes: calibrations stored on disk then miss
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Calibration:
    prefill: list[tuple[int, float]]  # (prompt tokens, seconds to first token)
    decode: list[tuple[int, float]]  # (batch size, seconds per decode step)

    def to_wire(self) -> dict:
        return {"prefill": [list(p) for p in self.prefill], "decode": [list(d) for d in self.decode]}

    @staticmethod
    def from_wire(raw: dict) -> "Calibration":
        return Calibration([(int(n), float(t)) for n, t in raw.get("prefill", ())],
                           [(int(b), float(t)) for b, t in raw.get("decode", ())])

    def rounded(self, digits: int = 4) -> dict[str, list[list[float]]]:
        """The curves with seconds to `digits` significant digits, for logs."""
        return {"prefill": [[n, _significant(t, digits)] for n, t in self.prefill],
                "decode": [[b, _significant(t, digits)] for b, t in self.decode]}

    def falling_points(self) -> dict[str, list[tuple[int, float]]]:
        """Per curve, the points monotonic_points drops (empty when both curves only rise)."""
        return {name: monotonic_points(points)[1] for name, points in (("prefill", self.prefill),
                                                                      ("decode", self.decode))}


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def monotonic_points(points: list[tuple[int, float]]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(kept, dropped), by size: a point whose seconds fall below those of an earlier kept point is dropped, so
    the kept points never fall. The first point is trusted: it is the cheapest run, hardest to inflate."""
    kept: list[tuple[int, float]] = []
    dropped: list[tuple[int, float]] = []
    for size, seconds in sorted((int(n), float(t)) for n, t in points):
        (dropped if kept and seconds < kept[-1][1] else kept).append((size, seconds))
    return kept, dropped


def log_calibration(calibration: Calibration, log: logging.Logger, how: str = "calibrated") -> None:
    """One line with the rounded curves after `how` (where they came from), and a warning for each curve that
    falls where it should rise."""
    curves = calibration.rounded()
    log.info("%s: prefill (tokens, s) %s, decode step (sequences, s) %s", how, curves["prefill"],
             curves["decode"], extra={"calibration": curves})
    for name, dropped in calibration.falling_points().items():
        if dropped:
            points = [[n, _significant(t, 4)] for n, t in dropped]
            log.warning("calibration: %s time falls as the size grows at %s; the cost model ignores those "
                        "points", name, points, extra={"curve": name, "dropped": points})


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # random ids, drawn afresh in each process (rng unseeded): found neither in the prefix cache nor in a KV
    # tier that an earlier run filled, so what is timed is computed
    return [rng.randrange(vocab) for _ in range(length)]


def _usable_lengths(max_len: int, budget_tokens: int) -> list[int]:
    return [n for n in PREFILL_LENGTHS if n < max_len and n <= budget_tokens]


def calibrate_engine(engine: EngineCore, seed: int | None = None, progress: Progress | None = None) -> Calibration:
    """Times whole requests through the public engine API; leaves the pool as it found it (blocks end CACHED).
    `progress` hears "calibrating" after each timing. `seed`: of the random prompts (None: fresh ones)."""
    rng = random.Random(seed)
    vocab = engine.source.config.vocab_size
    lengths, batches = decode_engine_plan(engine)
    plan = [("prefill", n) for n in lengths] + [("decode", b) for b in batches]
    measured: dict[str, list[tuple[int, float]]] = {"prefill": [], "decode": []}
    for kind, size in counted(plan, progress, CALIBRATING, len(plan)):
        seconds = _time_prefill(engine, _random_prompt(rng, size, vocab)) if kind == "prefill" \
            else _time_decode(engine, size, rng, vocab)
        measured[kind].append((size, seconds))
    return Calibration(measured["prefill"], measured["decode"])


def decode_engine_plan(engine: EngineCore) -> tuple[list[int], list[int]]:
    """(prompt lengths, decode batch sizes) that calibrate_engine measures: those this engine's context, pool
    (half of it, so that a measurement never preempts) and sequence limit allow."""
    budget = engine.pool.num_blocks * engine.pool.block_size // 2
    return (_usable_lengths(engine.max_model_len, budget),
            [b for b in DECODE_BATCHES if b <= engine.config.max_num_seqs and b * 16 < budget])


def prefill_engine_plan(engine: PrefillEngine) -> list[int]:
    """The prompt lengths calibrate_prefill_engine measures."""
    return _usable_lengths(engine.source.config.max_position_embeddings, max(PREFILL_LENGTHS))


def warm_up(engine: EngineCore, progress: Progress | None = None) -> None:
    """One short prefill and a few decode steps, paid at start-up rather than by the first request (what an
    engine that reuses an earlier calibration runs instead of calibrating)."""
    report(progress, WARMING_UP)
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(f"warm-up-{time.perf_counter_ns()}",
                                     _random_prompt(random.Random(), PREFILL_LENGTHS[0], engine.source.config.vocab_size),
                                     params))
    while engine.has_unfinished_requests():
        engine.step()


def _time_prefill(engine: EngineCore, prompt: list[int]) -> float:
    _run_one(engine, prompt)  # warm-up: first calls of a shape pay for allocation
    start = time.perf_counter()
    _run_one(engine, prompt[::-1])
    return time.perf_counter() - start


def _run_one(engine: EngineCore, prompt: list[int]) -> None:
    rid = f"calibrate-{time.perf_counter_ns()}"
    engine.add_request(EngineRequest(rid, prompt, ONE_TOKEN))
    while engine.has_unfinished_requests():
        engine.step()


def _time_decode(engine: EngineCore, batch: int, rng: random.Random, vocab: int) -> float:
    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(f"calibrate-d{batch}-{i}", _random_prompt(rng, 8, vocab), params))
    engine.step()  # every prompt prefilled in one step (8 * batch tokens fit the budget)
    engine.step()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = (time.perf_counter() - start) / DECODE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def calibrate_prefill_engine(engine: PrefillEngine, seed: int = 0, progress: Progress | None = None) -> Calibration:
    """Prefill timings against a scratch pool attached just for this; `progress` as calibrate_engine's."""
    rng = random.Random(seed)
    vocab = engine.source.config.vocab_size
    lengths = prefill_engine_plan(engine)
    with _scratch_pool(engine, max(PREFILL_LENGTHS)):
        samples = [(n, _time_job(engine, _random_prompt(rng, n, vocab)))
                   for n in counted(lengths, progress, CALIBRATING, len(lengths))]
    return Calibration(samples, [])


def warm_up_prefill(engine: PrefillEngine) -> None:
    """One short prefill into a scratch pool: what a prefill engine that reuses an earlier calibration runs
    instead of calibrating, so that its first request does not pay for the first calls' allocations."""
    with _scratch_pool(engine, PREFILL_LENGTHS[0]):
        _run_job(engine, _random_prompt(random.Random(0), PREFILL_LENGTHS[0], engine.source.config.vocab_size))


@contextmanager
def _scratch_pool(engine: PrefillEngine, tokens: int) -> Iterator[None]:
    """A pool of room for `tokens`, attached as "calibration" for the block and detached after it."""
    bs = engine.config.block_size
    scratch = KVCache(engine.source.config, -(-tokens // bs) + 1, bs, engine.dtype, engine.device,
                      kv_format=engine.config.kv_cache_dtype)
    engine.attach_pool("calibration", scratch)
    try:
        yield
    finally:
        engine.detach_pool("calibration")


def _time_job(engine: PrefillEngine, prompt: list[int]) -> float:
    _run_job(engine, prompt)
    start = time.perf_counter()
    _run_job(engine, prompt)
    return time.perf_counter() - start


def _run_job(engine: PrefillEngine, prompt: list[int]) -> None:
    table = list(range(-(-len(prompt) // engine.config.block_size)))
    engine.add(PrefillJob(f"calibrate-{time.perf_counter_ns()}", prompt, ONE_TOKEN, table, 0, "calibration",
                          time.monotonic() + 600))
    while engine.has_work():
        engine.step()
