"""A shifting workload against the elastic server and every static layout that fits the machine, in one run.

    python -m bench.elastic [--layouts elastic,colocated-2core,two-decode,split] [--phase-seconds 60]
                            [--rates 1,0.3,0.1] [--server-args '--dtype bfloat16'] [--out bench/results]
    python -m bench.elastic --quick --server-args '--model path/to/tiny --dtype float32'

Three phases back to back, each `--phase-seconds` long with Poisson arrivals at its rate (`--rates`: SISO, LISO,
LILO): SISO chat (short prompts and answers), LISO (prompts of `--long-in` tokens, 1024-2048, short answers), LILO
(long prompts and answers of `--long-out` tokens). Every server gets the same requests at the same times (one seed),
one server at a time so that each has the machine to itself:

- `elastic`: one prefill and one decode actor with `--elastic on`: the planner changes their roles, or merges their
  cores into one decode actor and splits them again, as the mix moves;
- `colocated-2core`: one decode actor on both cores, no prefill actor;
- `two-decode`: two decode actors, one core each, every request colocated;
- `split`: one prefill and one decode actor, one core each, `--disagg auto`.

Reported per server and phase, and over the whole run: goodput under interactive targets (requests per second with
TTFT at most 1 s for prompts under 512 tokens and 3 s above, and a mean time per output token (ITL) at most 100 ms;
an error is a miss), TTFT and ITL p50/p99 (ITL: the gaps between streamed chunks). Then the elastic server's
goodput against the best static layout's, over the run and per phase; and for the elastic server its layout over
time (GET /status every second) with each switch's reason. Results as JSON, and a plot of layout and latency over
time, under `--out`.

`--quick`: phases of 8 s at low rates with short prompts (long-in 200-400 tokens, long-out 32-64), to check that
the bench runs (against a tiny model: see --server-args); its figures measure nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp

from bench import workloads as wl
from bench.placement import wait_healthy
from bench.provenance import provenance

SERVER_FLAGS = {
    "elastic": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "auto", "--elastic", "on"],
    "colocated-2core": ["--decode-actors", "1", "--prefill-actors", "0"],
    "two-decode": ["--decode-actors", "2", "--prefill-actors", "0"],
    "split": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "auto"],
}
PHASES = ("siso", "liso", "lilo")
LONG_PROMPT = 512  # prompts from this many tokens have the long TTFT target
TTFT_SHORT, TTFT_LONG, ITL = 1.0, 3.0, 0.1
STATUS_SECONDS = 1.0


@dataclass(frozen=True)
class Plan:
    phase_seconds: float
    rates: tuple[float, float, float]  # SISO, LISO, LILO
    long_in: wl.LengthRange
    long_out: wl.LengthRange
    seed: int = 0

    def phases(self) -> list[tuple[str, float, float]]:
        """(quadrant, start, rate) of each phase."""
        return [(q, i * self.phase_seconds, rate) for i, (q, rate) in enumerate(zip(PHASES, self.rates))]

    def specs(self) -> dict[str, wl.QuadrantSpec]:
        short_in, short_out = wl.LengthRange(*wl.SHORT_IN), wl.LengthRange(*wl.SHORT_OUT)
        return {"siso": wl.QuadrantSpec("siso", short_in, short_out),
                "liso": wl.QuadrantSpec("liso", self.long_in, short_out),
                "lilo": wl.QuadrantSpec("lilo", self.long_in, self.long_out)}


def build_requests(plan: Plan, prompts: wl.PromptMaker) -> list[wl.RequestSpec]:
    """Every phase's Poisson arrivals, shifted to the phase's start and numbered in arrival order."""
    requests = []
    for i, (quadrant, start, rate) in enumerate(plan.phases()):
        mix = wl.Mix(((quadrant, 1.0),), label=quadrant)
        arrivals = wl.ArrivalPlan(rate, duration=plan.phase_seconds)
        for spec in wl.build_workload(mix, arrivals, plan.specs(), prompts, plan.seed * 10 + i):
            requests.append(replace(spec, arrival=start + spec.arrival))
    return [replace(spec, index=i) for i, spec in enumerate(sorted(requests, key=lambda s: s.arrival))]


def within_targets(record: wl.RequestRecord) -> bool:
    if record.error is not None or record.ttft is None:
        return False
    target = TTFT_LONG if record.prompt_tokens_target >= LONG_PROMPT else TTFT_SHORT
    return record.ttft <= target and (record.tpot is None or record.tpot <= ITL)


@dataclass(frozen=True)
class PhaseResult:
    requests: int
    errors: int
    goodput: float  # requests per second within targets
    attainment: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float


def phase_result(records: Sequence[wl.RequestRecord], seconds: float) -> PhaseResult:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in wl.itls(r)]
    met = sum(map(within_targets, records))
    return PhaseResult(len(records), len(records) - len(ok), met / seconds, met / len(records) if records else math.nan,
                       wl.percentile(ttft, 50), wl.percentile(ttft, 99), wl.percentile(gaps, 50),
                       wl.percentile(gaps, 99))


def summarise(records: Sequence[wl.RequestRecord], plan: Plan) -> dict[str, PhaseResult]:
    """Per phase (by the quadrant each request came from) and over the whole run."""
    out = {q: phase_result([r for r in records if r.quadrant == q], plan.phase_seconds) for q in PHASES}
    out["all"] = phase_result(records, plan.phase_seconds * len(PHASES))
    return out


def comparison(results: dict[str, dict[str, PhaseResult]]) -> dict[str, dict[str, float]]:
    """The elastic server's goodput over the best static layout's, per phase and over the run."""
    if "elastic" not in results or len(results) < 2:
        return {}
    out = {}
    for key in (*PHASES, "all"):
        static = {name: r[key].goodput for name, r in results.items() if name != "elastic"}
        best = max(static, key=static.get)
        out[key] = {"best_static": best, "best_static_goodput": static[best],
                    "elastic_goodput": results["elastic"][key].goodput,
                    "ratio": results["elastic"][key].goodput / static[best] if static[best] else math.inf}
    return out


# ------------------------------------------------------------------------------------------------ servers
def start_server(layout: str, port: int, extra: Sequence[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "cli.py", "serve", "--port", str(port), "--log-level", "info", *SERVER_FLAGS[layout],
           *extra]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def watch_layout(url: str, samples: list[dict], clock: wl.Clock, stop: asyncio.Event) -> None:
    """GET /status every second: the layout, and the planner's decision when it changes."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(f"{url}/status", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    layout = (await resp.json()).get("layout") or {}
                decision = layout.get("decision") or {}
                samples.append({"t": clock.now(), "layout": layout.get("current"),
                                "switches": layout.get("switches"), "reason": decision.get("reason")})
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), STATUS_SECONDS)
            except asyncio.TimeoutError:
                pass


async def run_against(url: str, requests: list[wl.RequestSpec], timeout: float
                      ) -> tuple[list[wl.RequestRecord], list[dict]]:
    target, opts = wl.Target(url, url), wl.ClientOptions(timeout=timeout)
    samples: list[dict] = []
    stop = asyncio.Event()
    async with wl.make_session(None) as session:
        clock = wl.Clock.start()
        watcher = asyncio.create_task(watch_layout(url, samples, clock, stop))
        records = await asyncio.gather(*(_fire(session, target, opts, spec, clock) for spec in requests))
        stop.set()
        await watcher
    return list(records), samples


async def _fire(session: aiohttp.ClientSession, target: wl.Target, opts: wl.ClientOptions, spec: wl.RequestSpec,
                clock: wl.Clock) -> wl.RequestRecord:
    await asyncio.sleep(max(0.0, spec.arrival - clock.now()))
    return await wl.run_request(session, target, opts, spec, clock)


def switches(samples: Sequence[dict]) -> list[dict]:
    """The samples at which the layout changed, with the reason the planner gave."""
    return [s for prev, s in zip(samples, samples[1:]) if s["layout"] != prev["layout"]]


# ------------------------------------------------------------------------------------------------ report
def format_table(results: dict[str, dict[str, PhaseResult]]) -> str:
    lines = [f"{'server':<16} {'phase':<5} {'reqs':>5} {'err':>4} {'goodput/s':>9} {'within':>7} "
             f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"]
    for name, by_phase in results.items():
        for key, r in by_phase.items():
            lines.append(f"{name:<16} {key:<5} {r.requests:>5} {r.errors:>4} {r.goodput:>9.3f} "
                         f"{_pct(r.attainment):>7} {_ms(r.ttft_p50):>9} {_ms(r.ttft_p99):>9} {_ms(r.itl_p50):>8} "
                         f"{_ms(r.itl_p99):>8}")
    return "\n".join(lines)


def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1e3:.0f}ms"


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0%}"


def plot(path: Path, records: dict[str, list[wl.RequestRecord]], samples: list[dict], plan: Plan) -> Path | None:
    """TTFT of each request over time per server, and the elastic server's layout over time."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=(3, 1))
    for name, recs in records.items():
        done = [(r.sent, r.ttft) for r in recs if r.ttft is not None]
        top.scatter([t for t, _ in done], [v for _, v in done], s=6, label=name)
    top.set_yscale("log")
    top.set_ylabel("TTFT (s)")
    top.legend()
    layouts = sorted({s["layout"] for s in samples if s["layout"]})
    bottom.step([s["t"] for s in samples], [layouts.index(s["layout"]) if s["layout"] in layouts else -1
                                             for s in samples], where="post")
    bottom.set_yticks(range(len(layouts)), layouts)
    bottom.set_xlabel("seconds (phases: " + ", ".join(f"{q} from {start:g}" for q, start, _ in plan.phases()) + ")")
    for _, start, _ in plan.phases():
        top.axvline(start, color="grey", lw=0.5)
        bottom.axvline(start, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(SERVER_FLAGS), help="servers to compare, in order")
    p.add_argument("--phase-seconds", type=float, default=60.0)
    p.add_argument("--rates", default="1,0.3,0.1", help="requests per second of the SISO, LISO and LILO phases")
    p.add_argument("--long-in", default="1024,2048", help="long prompt tokens, LO,HI")
    p.add_argument("--long-out", default="128,512", help="long output tokens, LO,HI")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) for exact prompt lengths")
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. '--dtype bfloat16'")
    p.add_argument("--base-port", type=int, default=8301)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="folder for the JSON, the plot and the server logs")
    p.add_argument("--quick", action="store_true", help="a short run that checks the bench works")
    args = p.parse_args(argv)
    if args.quick:
        args.phase_seconds, args.rates, args.long_in, args.long_out = 8.0, "1,0.3,0.2", "200,400", "32,64"
    unknown = [x for x in args.layouts.split(",") if x not in SERVER_FLAGS]
    if unknown:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(SERVER_FLAGS)}")
    return args


def _pair(text: str, name: str) -> wl.LengthRange:
    try:
        lo, hi = (int(x) for x in text.split(","))
        return wl.LengthRange(lo, hi)
    except ValueError as exc:
        raise SystemExit(f"--{name} must be LO,HI tokens with 1 <= LO <= HI, got {text!r} ({exc})") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rates = tuple(float(x) for x in args.rates.split(","))
    if len(rates) != 3 or not all(r > 0 for r in rates):
        raise SystemExit(f"--rates needs three positive rates (SISO, LISO, LILO), got {args.rates!r}")
    plan = Plan(args.phase_seconds, rates, _pair(args.long_in, "long-in"), _pair(args.long_out, "long-out"),
                args.seed)
    requests = build_requests(plan, wl.PromptMaker(args.tokenizer))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    origin = provenance("elastic", argv)
    results, records, samples = {}, {}, {}
    for i, layout in enumerate(args.layouts.split(",")):
        url = f"http://127.0.0.1:{args.base_port + i}"
        print(f"{layout}: starting at {url} ({' '.join(SERVER_FLAGS[layout])}) ...", flush=True)
        proc = start_server(layout, args.base_port + i, args.server_args.split(), out / f"elastic-{stamp}-{layout}.log")
        try:
            wait_healthy(url, proc)
            print(f"{layout}: {len(requests)} requests over {plan.phase_seconds * 3:g} s", flush=True)
            records[layout], samples[layout] = asyncio.run(run_against(url, requests, args.timeout))
        finally:
            stop_server(proc)
        results[layout] = summarise(records[layout], plan)
    print(format_table(results))
    compared = comparison(results)
    for key, c in compared.items():
        print(f"{key}: elastic {c['elastic_goodput']:.3f}/s vs best static {c['best_static']} "
              f"{c['best_static_goodput']:.3f}/s: x{c['ratio']:.2f}")
    for s in switches(samples.get("elastic", [])):
        print(f"  at {s['t']:.0f} s -> {s['layout']}: {s['reason']}")
    path = out / f"elastic-{stamp}.json"
    path.write_text(json.dumps({"provenance": origin, "plan": {**asdict(plan), "long_in": asdict(plan.long_in),
                                                                "long_out": asdict(plan.long_out)},
                                "server_flags": {k: SERVER_FLAGS[k] for k in results},
                                "server_args": args.server_args,
                                "results": {k: {q: asdict(r) for q, r in v.items()} for k, v in results.items()},
                                "comparison": compared, "layout_samples": samples,
                                "records": {k: [asdict(r) for r in v] for k, v in records.items()}},
                               indent=1, default=str))
    picture = plot(out / f"elastic-{stamp}.png", records, samples.get("elastic", []), plan)
    print(f"results: {path}" + (f", plot: {picture}" if picture else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
