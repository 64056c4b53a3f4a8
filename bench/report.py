"""One Markdown page with PNG plots from the JSON files the benches write, for a capacity-planning ticket.

    python -m bench.report RESULT.json [RESULT.json ...] --out DIR

writes DIR/report.md and DIR/*.png. Each input is recognised by its "bench" key (bench/provenance.py):
- load_test (`python -m bench.load_test --json OUT`, one file per concurrency): throughput against concurrency,
  TTFT and chunk-gap CDFs per concurrency;
- workloads (`python -m bench.workloads`, its --out-dir/--name.json): TTFT and chunk-gap CDFs per quadrant, one
  line per server and run; with --compare, the comparison of the servers;
- placement (`python -m bench.placement`): the same, and the comparison of the placement policies;
- offline_throughput (`--json OUT`): tokens/s against batch size, ours and Hugging Face's;
- serve_latency (`--json OUT`): decode tokens/s against streams, server and embedded engine.
The page lists every input with its command line and time, then a table of headline numbers per bench, then
the plots. An input that is not JSON, has no known "bench" or lacks the fields its bench writes is an error
naming the file.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

QUADRANTS = ("siso", "liso", "silo", "lilo")
DPI = 80
GAP_FLOOR_S = 1e-4  # chunk gaps of 0 (tokens coalesced into one read) drawn here on the log axis
REQUIRED: Mapping[str, tuple[str, ...]] = {
    "load_test": ("config", "report", "requests"),
    "workloads": ("runs",),
    "placement": ("runs",),
    "offline_throughput": ("ours",),
    "serve_latency": ("streams",),
}


class ReportError(ValueError):
    """An input the report cannot use; the message names the file."""


@dataclass(frozen=True)
class Input:
    path: Path
    doc: Mapping[str, Any]

    @property
    def bench(self) -> str:
        return self.doc["bench"]

    @property
    def tag(self) -> str:
        """A short name for legends and file names: the file's stem."""
        return self.path.stem


def load_input(path: Path) -> Input:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: a bench result is a JSON object, this file holds a {type(doc).__name__}")
    bench = doc.get("bench")
    if bench is None:
        raise ReportError(f"{path}: no \"bench\" key, so not a result of a bench that bench.report reads "
                          f"(rerun the bench with this checkout; known: {', '.join(REQUIRED)})")
    if bench not in REQUIRED:
        raise ReportError(f"{path}: unknown bench {bench!r} (known: {', '.join(REQUIRED)})")
    missing = [k for k in REQUIRED[bench] if k not in doc]
    if missing:
        raise ReportError(f"{path}: a {bench} result without {', '.join(repr(k) for k in missing)}")
    return Input(path, doc)


def checked(inp: Input, build: Callable[[Input], Any]) -> Any:
    """Run a reader on one input; a field of the wrong shape becomes an error naming the file."""
    try:
        return build(inp)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        if isinstance(exc, ReportError):
            raise
        raise ReportError(f"{inp.path}: a {inp.bench} result of an unexpected shape "
                          f"({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------------------------------------ numbers
def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def _ms(v: Any) -> str:
    v = _num(v)
    return "-" if math.isnan(v) else f"{v * 1e3:.0f}" if v >= 0.01 else f"{v * 1e3:.1f}"


def _f(v: Any, digits: int = 1) -> str:
    v = _num(v)
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def _pct(v: Any) -> str:
    v = _num(v)
    return "-" if math.isnan(v) else f"{v * 100:.0f}%"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]


@dataclass(frozen=True)
class LoadPoint:
    """One load_test file: one concurrency."""
    inp: Input
    concurrency: int
    series: str  # runs against the same server with the same request shape share a line
    report: Mapping[str, Any]
    ttfts: list[float]
    gaps: list[float]


def load_point(inp: Input) -> LoadPoint:
    cfg, rep = inp.doc["config"], inp.doc["report"]
    ok = [r for r in inp.doc["requests"] if r["ok"]]
    series = f"{cfg['url']} ({cfg['endpoint']}, {cfg['max_tokens']} tokens per request)"
    return LoadPoint(inp, int(cfg["concurrency"]), series, rep, [r["ttft"] for r in ok if r["ttft"] is not None],
                     [g for r in ok for g in r["itls"]])


@dataclass(frozen=True)
class Run:
    """One run of a workloads / placement file: one server at one rate (or the bursts run)."""
    server: str
    label: str
    summary: Mapping[str, Mapping[str, Any]]
    ttfts: Mapping[str, list[float]]  # per quadrant and "all"
    gaps: Mapping[str, list[float]]


def workload_runs(inp: Input) -> list[Run]:
    runs = []
    for r in inp.doc["runs"]:
        ok = [x for x in r["records"] if x["error"] is None and not x.get("cut_off")]
        keys = [q for q in (*QUADRANTS, "all") if q in r["summary"]]
        ttfts = {k: [x["ttft"] for x in ok if k in ("all", x["quadrant"]) and x["ttft"] is not None] for k in keys}
        gaps = {k: [g for x in ok if k in ("all", x["quadrant"]) for g in x["itls"]] for k in keys}
        runs.append(Run(r["server"], r["label"], r["summary"], ttfts, gaps))
    if not runs:
        raise ReportError(f"{inp.path}: a {inp.bench} result with no runs")
    return runs


def describe_workload(inp: Input) -> str:
    cfg = inp.doc.get("config") or {}
    mix = (cfg.get("mix") or {}).get("label") or "?"
    servers = sorted({r["server"] for r in inp.doc["runs"]})
    what = "ITL under bursts" if cfg.get("itl_under_bursts") else f"mix {mix}"
    return f"{what} against {', '.join(servers)}"


# ------------------------------------------------------------------------------------------------ plots
def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, pil_kwargs={"optimize": True})
    plt.close(fig)
    return path


def ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Step points of the empirical CDF, from (smallest, 0), so that one sample still draws a step."""
    xs = np.sort(np.maximum(np.asarray(values, dtype=float), GAP_FLOOR_S))
    return np.concatenate([xs[:1], xs]), np.arange(len(xs) + 1) / len(xs)


def _cdf_axis(ax: Any, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelsize=7, labelrotation=45)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    _at_least_a_decade(ax)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)


def _at_least_a_decade(ax: Any) -> None:
    """Widen a narrow log axis to one decade around its data, so that the 1-2-5 ticks label it."""
    xs = np.concatenate([np.asarray(line.get_xdata(), dtype=float) for line in ax.lines]) if ax.lines else []
    if not len(xs):
        return
    lo, hi = float(np.min(xs)), float(np.max(xs))
    if hi / lo < 10:
        pad = math.sqrt(10 * lo / hi)
        ax.set_xlim(lo / pad, hi * pad)


TTFT_X = "time to first token (s, log scale)"
GAP_X = "gap between streamed chunks (s, log scale)"
TTFT_Y = "share of requests at or below"
GAP_Y = "share of gaps at or below"


def plot_load_cdfs(points: Sequence[LoadPoint], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for p in sorted(points, key=lambda p: (p.series, p.concurrency)):
        label = f"concurrency {p.concurrency}" + (f" ({p.inp.tag})" if len({q.series for q in points}) > 1 else "")
        for ax, values in zip(axes, (p.ttfts, p.gaps)):
            if values:
                ax.step(*ecdf(values), where="post", label=label)
    _cdf_axis(axes[0], TTFT_X, TTFT_Y)
    _cdf_axis(axes[1], GAP_X, GAP_Y)
    axes[0].set_title("time to first token", fontsize=9)
    axes[1].set_title("gaps between streamed chunks (inter-token latency)", fontsize=9)
    fig.suptitle(f"Load test latency by number of concurrent streams: {points[0].series}", fontsize=9)
    return _save(fig, plt, path)


def run_label(r: Run) -> str:
    rate = r.label.removeprefix("rate ")
    return f"{r.server}, {rate} req/s" if rate != r.label else f"{r.server}, {r.label}"


def plot_quadrant_cdfs(inp: Input, runs: Sequence[Run], path: Path) -> Path:
    """TTFT (top) and chunk gaps (bottom), one column per quadrant present, one line per server and run."""
    plt = _pyplot()
    keys = [q for q in (*QUADRANTS, "all") if any(q in r.ttfts for r in runs)]
    fig, axes = plt.subplots(2, len(keys), figsize=(2.9 * len(keys) + 0.5, 5.4), squeeze=False)
    for col, key in enumerate(keys):
        for r in runs:
            for row, values in enumerate((r.ttfts.get(key, []), r.gaps.get(key, []))):
                if values:
                    axes[row][col].step(*ecdf(values), where="post", label=run_label(r))
        name = "all requests" if key == "all" else key.upper()
        axes[0][col].set_title(f"{name}: time to first token", fontsize=9)
        axes[1][col].set_title(f"{name}: chunk gaps", fontsize=9)
        _cdf_axis(axes[0][col], TTFT_X, TTFT_Y if col == 0 else "")
        _cdf_axis(axes[1][col], GAP_X, GAP_Y if col == 0 else "")
    fig.suptitle(f"Latency per quadrant, {describe_workload(inp)} ({inp.path.name})", fontsize=10)
    return _save(fig, plt, path)


def plot_comparison(inp: Input, runs: Sequence[Run], path: Path) -> Path:
    """Per run label (rate), one bar per server: SLO attainment, TTFT p99, chunk-gap p99, all requests."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r.label for r in runs))
    servers = list(dict.fromkeys(r.server for r in runs))
    by = {(r.server, r.label): r.summary.get("all", {}) for r in runs}
    panels = (("slo_attainment", "share of requests meeting both SLOs", 1.0),
              ("ttft_p99", "99th percentile time to first token (s)", 1.0),
              ("itl_p99", "99th percentile chunk gap (s)", 1.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 3.6))
    width = 0.8 / len(servers)
    x = np.arange(len(labels))
    for ax, (key, ylabel, scale) in zip(axes, panels):
        for i, server in enumerate(servers):
            values = [_num(by.get((server, lab), {}).get(key)) * scale for lab in labels]
            ax.bar(x + (i - (len(servers) - 1) / 2) * width, np.nan_to_num(values), width, label=server)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlabel("run (arrival rate in requests per second)", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=7, title="policy" if inp.bench == "placement" else "server", title_fontsize=7)
    what = "Placement policies" if inp.bench == "placement" else "Servers"
    fig.suptitle(f"{what} compared on the same workload: {describe_workload(inp)}", fontsize=9)
    return _save(fig, plt, path)


@dataclass
class Series:
    label: str
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)


def throughput_series(loads: Sequence[LoadPoint], offline: Sequence[Input], serve: Sequence[Input]) -> list[Series]:
    out: dict[str, Series] = {}
    for p in sorted(loads, key=lambda p: p.concurrency):
        s = out.setdefault(p.series, Series(f"load test: {p.series}"))
        s.xs.append(p.concurrency)
        s.ys.append(_num(p.report["output_tokens_per_second"]))
    for inp in offline:
        ours = Series(f"offline LLM.generate, prefill and decode ({inp.tag})")
        for r in sorted(inp.doc["ours"], key=lambda r: r["batch"]):
            ours.xs.append(r["batch"])
            ours.ys.append(_num(r["tokens_per_s"]))
        hf = Series(f"offline Hugging Face generate ({inp.tag})")
        for b, r in sorted((inp.doc.get("hf") or {}).items(), key=lambda kv: int(kv[0])):
            hf.xs.append(int(b))
            hf.ys.append(_num(r["tokens_per_s"]))
        out.update({s.label: s for s in (ours, hf) if s.xs})
    for inp in serve:
        for side, words in (("server", "server, decode only"), ("embedded", "embedded engine, decode only")):
            s = Series(f"serve_latency {words} ({inp.tag})")
            for n, sides in sorted(inp.doc["streams"].items(), key=lambda kv: int(kv[0])):
                s.xs.append(int(n))
                s.ys.append(statistics.median(_num(x["aggregate_tok_s"]) for x in sides[side]))
            out[s.label] = s
    return list(out.values())


def throughput_title(loads: Sequence[LoadPoint], offline: Sequence[Input], serve: Sequence[Input]) -> str:
    parts = []
    if loads:
        shapes = sorted({f"{p.report['requests']} requests of {p.inp.doc['config']['max_tokens']} tokens"
                         for p in loads})
        parts.append(f"load test, {' or '.join(shapes)} per point")
    for inp in offline:
        a = inp.doc.get("args") or {}
        parts.append(f"offline, {a.get('input_len', '?')} tokens in, {a.get('output_len', '?')} out, "
                     f"{a.get('dtype', '?')}")
    for inp in serve:
        c = inp.doc.get("config") or {}
        parts.append(f"serve_latency ({inp.doc.get('mode', '?')}), {c.get('max_tokens', '?')} tokens per stream")
    return "\n".join(["Output throughput against concurrency", *parts])


def plot_throughput(series: Sequence[Series], title: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.0 + 0.15 * title.count("\n")))
    for s in series:
        ax.plot(s.xs, s.ys, marker="o", label=s.label)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for s in series for x in s.xs})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("concurrent requests (streams or batch size)", fontsize=9)
    ax.set_ylabel("output tokens per second", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    return _save(fig, plt, path)


# ------------------------------------------------------------------------------------------------ the page
def inputs_section(inputs: Sequence[Input]) -> list[str]:
    rows = [(f"`{i.path.name}`", i.bench, i.doc.get("timestamp") or "not recorded",
             f"`{i.doc['command']}`" if i.doc.get("command") else "not recorded") for i in inputs]
    return ["## Inputs", "", *table(("file", "bench", "run at (UTC)", "command"), rows), ""]


def load_section(points: Sequence[LoadPoint]) -> list[str]:
    rows = [(p.inp.path.name, p.series, p.concurrency, p.report["requests"], p.report["errors"],
             _f(p.report["requests_per_second"], 2), _f(p.report["output_tokens_per_second"]),
             f"{_ms(p.report['ttft_p50'])} / {_ms(p.report['ttft_p99'])}",
             f"{_ms(p.report['itl_p50'])} / {_ms(p.report['itl_p99'])}", _f(p.report["latency_p50"], 2))
            for p in sorted(points, key=lambda p: (p.series, p.concurrency))]
    header = ("file", "server and requests", "concurrency", "requests", "errors", "requests/s", "output tokens/s",
              "TTFT p50 / p99 (ms)", "chunk gap p50 / p99 (ms)", "latency p50 (s)")
    return ["### Load test", "", *table(header, rows), ""]


def workload_section(inp: Input, runs: Sequence[Run]) -> list[str]:
    cfg = inp.doc.get("config") or {}
    slo = cfg.get("slo") or {}
    rows = []
    for r in runs:
        for key in (*QUADRANTS, "all"):
            s = r.summary.get(key)
            if s:
                rows.append((r.server, r.label, key.upper() if key != "all" else "all", s["count"], s["errors"],
                             f"{_ms(s['ttft_p50'])} / {_ms(s['ttft_p99'])}",
                             f"{_ms(s['tpot_p50'])} / {_ms(s['tpot_p99'])}",
                             f"{_ms(s['itl_p50'])} / {_ms(s['itl_p99'])}", _pct(s["slo_attainment"])))
    header = ("server", "run", "quadrant", "requests", "errors", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)",
              "chunk gap p50 / p99 (ms)", "SLO met")
    title = "Placement comparison" if inp.bench == "placement" else "Workloads"
    lines = [f"### {title}: {describe_workload(inp)} (`{inp.path.name}`)", ""]
    if slo:
        lines += [f"SLO: time to first token at most {slo.get('ttft')} s and time per output token at most "
                  f"{slo.get('tpot')} s; a run passes when at least {_pct(slo.get('target'))} of its requests "
                  f"meet both.", ""]
    if inp.bench == "placement" and inp.doc.get("policies"):
        lines += ["Policies: " + "; ".join(f"`{k}` = `{' '.join(v)}`" for k, v in inp.doc["policies"].items()), ""]
    lines += [*table(header, rows), ""]
    goodputs = inp.doc.get("goodput") or {}
    sweeps = {k: g for k, g in goodputs.items() if len(g.get("rates") or ()) > 1}
    if sweeps:
        grows = [(k, ">= " + _f(g["max_passing_rate"], 2) if g["all_pass"] else _f(g["interpolated_rate"], 2),
                  ", ".join(f"{r:g}/s: {_pct(a)}" for r, a in zip(g["rates"], g["attainment"])))
                 for k, g in sweeps.items()]
        lines += [*table(("server", "goodput (requests/s)", "SLO met per rate"), grows), ""]
    return lines


def offline_section(inputs: Sequence[Input]) -> list[str]:
    rows = []
    for inp in inputs:
        hf = inp.doc.get("hf") or {}
        for r in inp.doc["ours"]:
            h = hf.get(str(r["batch"])) or hf.get(r["batch"]) or {}
            rows.append((inp.path.name, r["batch"], _f(r["tokens_per_s"]), _f(h.get("tokens_per_s")),
                         _f(r.get("ttft_p50_ms")), _f(r.get("tpot_p50_ms"), 2), r.get("error") or ""))
    header = ("file", "batch", "tokens/s (ours)", "tokens/s (Hugging Face)", "TTFT p50 (ms)", "TPOT p50 (ms)",
              "error")
    return ["### Offline throughput", "", *table(header, rows), ""]


def serve_section(inputs: Sequence[Input]) -> list[str]:
    rows = []
    for inp in inputs:
        for n, sides in sorted(inp.doc["streams"].items(), key=lambda kv: int(kv[0])):
            med = {side: (statistics.median(_num(x["per_token_ms"]) for x in sides[side]),
                          statistics.median(_num(x["aggregate_tok_s"]) for x in sides[side]))
                   for side in ("embedded", "server")}
            rows.append((inp.path.name, inp.doc.get("mode", "?"), n, _f(med["embedded"][0], 2),
                         _f(med["server"][0], 2), _f(med["embedded"][1]), _f(med["server"][1])))
    header = ("file", "server mode", "streams", "embedded ms/token", "server ms/token", "embedded tokens/s",
              "server tokens/s")
    return ["### Server against embedded engine (medians of rounds)", "", *table(header, rows), ""]


def _image(path: Path, alt: str) -> list[str]:
    return [f"![{alt}]({path.name})", ""]


def build_report(paths: Sequence[Path], out: Path) -> Path:
    """Read every input (all of them, before anything is written), write out/report.md and its plots."""
    inputs = [load_input(Path(p)) for p in paths]
    if not inputs:
        raise ReportError("no input files")
    kinds: dict[str, list[Input]] = {}
    for inp in inputs:
        kinds.setdefault(inp.bench, []).append(inp)
    loads = [checked(i, load_point) for i in kinds.get("load_test", [])]
    workloads = [(i, checked(i, workload_runs)) for i in kinds.get("workloads", []) + kinds.get("placement", [])]
    offline, serve = kinds.get("offline_throughput", []), kinds.get("serve_latency", [])
    headline = [*(load_section(loads) if loads else []),
                *(line for i, runs in workloads for line in checked(i, lambda i: workload_section(i, runs))),
                *(checked(offline[0], lambda _: offline_section(offline)) if offline else []),
                *(checked(serve[0], lambda _: serve_section(serve)) if serve else [])]
    series = checked(inputs[0], lambda _: throughput_series(loads, offline, serve))
    title = checked(inputs[0], lambda _: throughput_title(loads, offline, serve))

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = ["# Benchmark report", "", f"Generated {now} by `python -m bench.report` from {len(inputs)} "
             f"file{'s' if len(inputs) > 1 else ''}. Times are from the client's side; TTFT is the time from "
             "sending a request to its first streamed text, a chunk gap is the time between two streamed chunks "
             "with text (inter-token latency; a chunk may hold more than one token).", ""]
    lines += inputs_section(inputs)
    lines += ["## Headline numbers", "", *headline]
    if any(len(s.xs) for s in series):
        lines += ["## Throughput against concurrency", "",
                  "Output tokens per second at each number of concurrent requests. Load tests count every "
                  "request's output over the whole run's wall time; offline runs count a batch's output over its "
                  "wall time; serve_latency counts decode tokens only.", ""]
        lines += _image(plot_throughput(series, title, out / "throughput.png"), "output tokens per second against "
                        "concurrent requests")
    if loads or workloads:
        lines += ["## Latency distributions", "",
                  "Each curve is the share of requests (or of chunk gaps) at or below a time; further left is "
                  "faster, and the top of a curve is its tail. Gaps of zero (tokens that arrived in one read) are "
                  f"drawn at {GAP_FLOOR_S:g} s.", ""]
    by_series: dict[str, list[LoadPoint]] = {}
    for p in loads:
        by_series.setdefault(p.series, []).append(p)
    for i, points in enumerate(by_series.values()):
        name = "load_test_cdf.png" if len(by_series) == 1 else f"load_test_cdf_{i + 1}.png"
        lines += [f"### Load test: {points[0].series}", ""]
        lines += _image(plot_load_cdfs(points, out / name), "load test latency CDFs by concurrency")
    for inp, runs in workloads:
        lines += [f"### Per quadrant: {describe_workload(inp)} (`{inp.path.name}`)", ""]
        lines += _image(plot_quadrant_cdfs(inp, runs, out / f"{inp.tag}_quadrant_cdf.png"),
                        "TTFT and chunk-gap CDFs per quadrant")
    compared = [(inp, runs) for inp, runs in workloads if inp.bench == "placement" or len({r.server for r in runs}) > 1]
    if compared:
        lines += ["## Placement comparison", "",
                  "The same requests against each server (policy) in turn: the share of requests that met both "
                  "SLOs, and the 99th percentiles of time to first token and of the chunk gaps.", ""]
        for inp, runs in compared:
            lines += _image(plot_comparison(inp, runs, out / f"{inp.tag}_comparison.png"),
                            "SLO attainment and tail latencies per policy")
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="JSON files written by the benches")
    p.add_argument("--out", required=True, type=Path, help="folder for report.md and the PNG plots")
    args = p.parse_args(argv)
    try:
        report = build_report(args.results, args.out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {report} and {len(list(args.out.glob('*.png')))} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
