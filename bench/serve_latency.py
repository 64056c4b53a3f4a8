"""Per-token time through `cli.py serve` against the embedded engine, on the same model and prompts, in one run.

    python -m bench.serve_latency [--streams 1,2,4,8] [--max-tokens 128] [--input-len 64] [--rounds 3]
        [--in-process] [--server-flags FLAGS] [--model PATH] [--json OUT] [--trace]

For each number of concurrent streams N, both sides generate N distinct prompts of --input-len token ids to
exactly --max-tokens tokens each (greedy, EOS ignored):
- embedded: `LLM.generate` in this process; its decode time is the wall time of the N prompts to --max-tokens
  tokens less that of the same N prompts to one token (the prefill), so it covers --max-tokens - 1 steps;
- server: `python cli.py serve` (actor mode, or --in-process) in a subprocess, read with the official `openai`
  client's streaming (`AsyncOpenAI().completions.create(stream=True)`), one task per stream; a stream's decode
  time runs from its first text chunk to its last, over its usage's completion tokens - 1.
Per-token time is decode time / (tokens - 1) (the median stream for the server), aggregate tok/s is
N * (tokens - 1) / decode time. The ratio column is server / embedded per-token time (goal: at most 1.15 at one
stream) and server / embedded aggregate (goal: at least 0.9 at 8 streams). Rounds alternate the two sides and
report medians. With actors, the server's main process (the front end and router) and this process (the client)
also give their CPU time per stream event (every chunk read), the cost `--stream-interval auto` budgets for
(engine/core/stream_interval.py).

--trace serves with --trace-tokens and prints, per number of streams, the median time of each hop a chunk's
tokens take: engine step done -> frame sent (actor loop) -> received (router) -> detokenised -> handed to the
socket -> read by the openai client, from the stamps each chunk carries (one host: one monotonic clock).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone lantern harbour meadow signal copper winter garden thunder paper orbit candle forest "
         "engine silver bridge market violin desert").split()


@dataclass(frozen=True)
class Side:
    streams: int
    per_token_ms: float
    aggregate_tok_s: float
    events: int = 0  # stream chunks read (the server only)
    server_cpu_ms: float | None = None  # the server's main process's CPU time over the round, where measured
    client_cpu_ms: float | None = None  # this process's


def prompts(tokenizer, count: int, length: int, round_index: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids (fresh each round: no prefix-cache hits)."""
    out = []
    for i in range(count):
        words = [WORDS[(i * 7 + round_index * 3 + j) % len(WORDS)] for j in range(4 * length)]
        ids = tokenizer.encode(f"Prompt {round_index}-{i}: " + " ".join(words))
        out.append(ids[:length])
    return out


def embedded(llm, batch: list[list[int]], max_tokens: int) -> Side:
    from engine import SamplingParams

    def run(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    decode = run(max_tokens) - run(1)
    steps = max_tokens - 1
    return Side(len(batch), decode / steps * 1e3, len(batch) * steps / decode)


async def one_stream(client, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    """-> (seconds from the first text chunk to the last, completion tokens, chunks read)."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    first = last = None
    tokens = chunks = 0
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].text:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (last - first) if first else 0.0, tokens, chunks


HOPS = ("step->sent", "sent->received", "received->detokenised", "detokenised->written", "written->read")


async def traced_stream(client, model: str, prompt: list[int], max_tokens: int) -> list[list[float]]:
    """-> per text chunk, the hop times in seconds (HOPS)."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    hops = []
    async for chunk in stream:
        read = time.monotonic()
        stamps = (chunk.model_extra or {}).get("phase_serve_trace")
        if stamps and chunk.choices and chunk.choices[0].text:
            times = [*stamps, read]
            hops.append([b - a for a, b in zip(times, times[1:])])
    return hops


async def traced(url: str, model: str, batch: list[list[int]], max_tokens: int) -> list[list[float]]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        results = await asyncio.gather(*(traced_stream(client, model, p, max_tokens) for p in batch))
    return [hop for stream in results for hop in stream[1:]]  # the first chunk also waited for the prefill


def print_trace(rows: dict[int, list[list[float]]], mode: str) -> None:
    print(f"per-hop time of a chunk through the server ({mode}), median microseconds")
    print("streams  " + "  ".join(f"{h:>22}" for h in HOPS) + "      total")
    for n, hops in rows.items():
        medians = [statistics.median(h[i] for h in hops) * 1e6 for i in range(len(HOPS))]
        total = statistics.median(sum(h) for h in hops) * 1e6
        print(f"{n:>7}  " + "  ".join(f"{v:>22.0f}" for v in medians) + f"  {total:>9.0f}")


async def served(url: str, model: str, batch: list[list[int]], max_tokens: int, server_pid: int | None) -> Side:
    """The streams of `batch` through the server; `server_pid`: the process whose CPU time to take (None: none)."""
    from openai import AsyncOpenAI

    server_cpu, client_cpu = cpu_seconds(server_pid), time.process_time()
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        results = await asyncio.gather(*(one_stream(client, model, p, max_tokens) for p in batch))
    server_ms = None if server_pid is None else (cpu_seconds(server_pid) - server_cpu) * 1e3
    client_ms = (time.process_time() - client_cpu) * 1e3
    steps = [tokens - 1 for _, tokens, _ in results]
    per_token = statistics.median(seconds / n for (seconds, _, _), n in zip(results, steps))
    decode = statistics.median(seconds for seconds, _, _ in results)
    return Side(len(batch), per_token * 1e3, sum(steps) / decode, sum(chunks for _, _, chunks in results),
                server_ms, client_ms)


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds of process `pid` (0.0 for None)."""
    if pid is None:
        return 0.0
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def per_event_ms(sides: list[Side], field: str) -> float | None:
    """The median over rounds of `field` (server_cpu_ms or client_cpu_ms) per event, None where not measured."""
    values = [getattr(s, field) / s.events for s in sides if getattr(s, field) is not None and s.events]
    return statistics.median(values) if values else None


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "cli.py", "serve", "--port", "0", "--log-level", "info", *extra],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        found = re.search(r"serving .* on (http://\S+)", line)
        if found:  # keep reading its stderr, so that a full pipe never blocks the server
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
    raise RuntimeError(f"the server exited ({proc.wait()}) before it served")


def print_table(rows: dict[int, tuple[list[Side], list[Side]]], mode: str) -> None:
    print(f"server ({mode}) against the embedded engine; medians of rounds; CPU ms per stream event")
    print("streams  embedded ms/token  server ms/token  ratio   embedded tok/s  server tok/s  ratio   "
          "events  server CPU  client CPU")
    for n, (emb, srv) in rows.items():
        e_ms, s_ms = (statistics.median(s.per_token_ms for s in side) for side in (emb, srv))
        e_tps, s_tps = (statistics.median(s.aggregate_tok_s for s in side) for side in (emb, srv))
        events = statistics.median(s.events for s in srv)
        cpu = [per_event_ms(srv, field) for field in ("server_cpu_ms", "client_cpu_ms")]
        cpu_text = "  ".join(f"{'-' if v is None else f'{v:.3f}':>10}" for v in cpu)
        print(f"{n:>7}  {e_ms:>17.2f}  {s_ms:>15.2f}  {s_ms / e_ms:>5.2f}   {e_tps:>14.1f}  {s_tps:>12.1f}  "
              f"{s_tps / e_tps:>5.2f}  {events:>7.0f}  {cpu_text}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,2,4,8", help="comma-separated numbers of concurrent streams")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--in-process", action="store_true", help="serve with --in-process instead of actors")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M)")
    p.add_argument("--server-flags", default="", help="more `cli.py serve` flags, e.g. '--threads 1'")
    p.add_argument("--json", default=None, help="write the rounds to this file")
    p.add_argument("--trace", action="store_true", help="per-hop times from --trace-tokens stamps instead")
    args = p.parse_args(argv)
    args.stream_counts = [int(n) for n in args.streams.split(",") if n.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    from engine import LLM

    args = parse_args(argv)
    origin = provenance("serve_latency", argv)
    model_flags = ["--model", args.model] if args.model else []
    if args.trace:
        return trace_main(args, model_flags)
    llm = LLM(args.model)
    rows: dict[int, tuple[list[Side], list[Side]]] = {n: ([], []) for n in args.stream_counts}
    proc, url = start_server(model_flags + (["--in-process"] if args.in_process else []) + args.server_flags.split())
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            name = json.loads(response.read())["data"][0]["id"]
        for r in range(args.rounds):
            for n in args.stream_counts:
                batch = prompts(llm.tokenizer, n, args.input_len, r)
                rows[n][0].append(embedded(llm, batch, args.max_tokens))
                server_pid = None if args.in_process else proc.pid  # in process, its CPU is the engine's too
                rows[n][1].append(asyncio.run(served(url, name, prompts(llm.tokenizer, n, args.input_len,
                                                                         r + args.rounds), args.max_tokens,
                                                     server_pid)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print_table(rows, "in-process" if args.in_process else "actors")
    if args.json:
        Path(args.json).write_text(json.dumps(result_json(args, rows, origin), indent=2))


def result_json(args: argparse.Namespace, rows: dict[int, tuple[list[Side], list[Side]]], origin: dict) -> dict:
    """Every round of both sides, per number of streams; `origin` is the provenance taken at the start."""
    config = {k: v for k, v in vars(args).items() if k != "stream_counts"}
    return {**origin, "config": config,
            "mode": "in-process" if args.in_process else "actors",
            "streams": {str(n): {"embedded": [asdict(s) for s in emb], "server": [asdict(s) for s in srv]}
                        for n, (emb, srv) in rows.items()}}


def trace_main(args: argparse.Namespace, model_flags: list[str]) -> None:
    from engine.model.loader import resolve_model

    tokenizer = resolve_model(args.model).tokenizer
    rows: dict[int, list[list[float]]] = {n: [] for n in args.stream_counts}
    proc, url = start_server(model_flags + ["--trace-tokens"] + (["--in-process"] if args.in_process else [])
                             + args.server_flags.split())
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            name = json.loads(response.read())["data"][0]["id"]
        for r in range(args.rounds):
            for n in args.stream_counts:
                rows[n] += asyncio.run(traced(url, name, prompts(tokenizer, n, args.input_len, r), args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print_trace(rows, "in-process" if args.in_process else "actors")


if __name__ == "__main__":
    main()
