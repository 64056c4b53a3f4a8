"""Multi-turn conversations over shared documents, with a KV pool too small for them: no tier, the host tier, host
and disk tiers, each on a fresh `cli.py serve`, in one run.

    python -m bench.kv_tiers [--conversations 24] [--turns 6] [--documents 4] [--doc-tokens 1500]
        [--kv-cache-memory 96MiB] [--kv-host-size 192MiB] [--kv-disk-size 4GiB] [--concurrency 2]
        [--max-tokens 32] [--configs none,host,host+disk] [--model PATH] [--server-flags FLAGS] [--json OUT]
    python -m bench.kv_tiers --quick

Conversation i opens with document i mod --documents (English-like prose of about --doc-tokens tokens, the same
in every configuration) and asks --turns short questions; every turn resends the whole history (the document, the
questions and the model's answers so far) as one streaming chat completion (greedy, ignore_eos, --max-tokens).
Turns go round by round: the first turn of every conversation, then the second of every conversation, and so on,
at most --concurrency at once. So between two turns of one conversation all the others run, and a pool that
holds a few histories has evicted it: without a tier each turn recomputes its history (the pool's LRU meets the
documents in a cycle longer than it holds), with the tiers it loads what was evicted.

Configurations (--configs): none, the pool alone (its prefix cache); host, --kv-host-size of shared memory below
it; host+disk, the same host tier and a disk tier (--kv-disk-size in a fresh temporary directory). A host tier
smaller than the working set (the default) leaves the disk tier something to serve.

Reported per configuration: TTFT (request sent -> first chunk with text) p50 and p90 over every turn; prefill
tokens computed (per turn, the prompt tokens less the cached tokens its usage reports, summed); cached tokens;
the blocks each tier served (GET /status); wall time; throughput (output tokens and turns per second of wall
time). Issue 39's goal: TTFT p50 at least 3x lower with the tiers than without.

--quick: 4 conversations of 3 turns on 2 documents of 300 tokens, a 16MiB pool, a 32MiB host tier, one
conversation at a time: that the bench runs, nothing worth keeping.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np

from bench.provenance import provenance
from bench.serve_latency import start_server
from bench.workloads import SseDecoder, english_words, estimated_words, parse_event, percentile

CONFIGS = ("none", "host", "host+disk")
QUESTION_TOKENS = 24
TIMEOUT_SECONDS = 600.0  # one turn's hang guard


@dataclass(frozen=True)
class Workload:
    conversations: int = 24
    turns: int = 6
    documents: int = 4
    doc_tokens: int = 1500
    max_tokens: int = 32
    concurrency: int = 2
    seed: int = 0


QUICK = Workload(conversations=4, turns=3, documents=2, doc_tokens=300, max_tokens=8, concurrency=1)


@dataclass(frozen=True)
class Tiers:
    kv_cache_memory: str = "96MiB"
    kv_host_size: str = "192MiB"
    kv_disk_size: str = "4GiB"


QUICK_TIERS = Tiers("16MiB", "32MiB", "64MiB")


def prose(seed: int, tokens: int) -> str:
    words = estimated_words(tokens)
    return " ".join(english_words(np.random.default_rng(seed), words)[:words])


def documents(w: Workload) -> list[str]:
    return [prose(w.seed * 1000 + d, w.doc_tokens) for d in range(w.documents)]


def question(w: Workload, conversation: int, turn: int) -> str:
    return prose(w.seed * 1000 + 100_000 + conversation * 100 + turn, QUESTION_TOKENS) + "?"


@dataclass
class Conversation:
    """One conversation's history: the document first, then the questions and the answers so far."""

    index: int
    messages: list[dict] = field(default_factory=list)

    def ask(self, text: str) -> list[dict]:
        self.messages.append({"role": "user", "content": text})
        return list(self.messages)

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def conversations(w: Workload) -> list[Conversation]:
    docs = documents(w)
    return [Conversation(i, [{"role": "system", "content": "Answer questions about this document.\n\n"
                                                           + docs[i % w.documents]}])
            for i in range(w.conversations)]


@dataclass(frozen=True)
class Turn:
    """What one turn measured."""

    conversation: int
    turn: int
    ttft: float | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    error: str | None = None


async def run_turn(session: aiohttp.ClientSession, url: str, model: str, convo: Conversation, turn: int,
                   w: Workload) -> Turn:
    body = {"model": model, "messages": convo.ask(question(w, convo.index, turn)), "max_tokens": w.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, text, usage = time.perf_counter(), None, [], {}
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)) as response:
            if response.status != 200:
                return Turn(convo.index, turn, None, 0, 0, 0, f"HTTP {response.status}: {await response.text()}")
            decoder = SseDecoder()
            async for raw in response.content.iter_any():
                for payload in decoder.feed(raw):
                    event = parse_event(payload)
                    if event.error:
                        return Turn(convo.index, turn, None, 0, 0, 0, event.error)
                    if event.text and first is None:
                        first = time.perf_counter()
                    text.append(event.text)
                    usage = event.usage or usage
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Turn(convo.index, turn, None, 0, 0, 0, f"{type(exc).__name__}: {exc}")
    convo.answered("".join(text))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Turn(convo.index, turn, None if first is None else first - sent, usage.get("prompt_tokens", 0), cached,
                usage.get("completion_tokens", 0))


async def run_workload(url: str, model: str, w: Workload) -> tuple[list[Turn], float]:
    """Every turn, round by round, at most w.concurrency at once; (the turns, wall seconds)."""
    convos = conversations(w)
    limit = asyncio.Semaphore(w.concurrency)
    turns: list[Turn] = []

    async def one(session: aiohttp.ClientSession, convo: Conversation, turn: int) -> None:
        async with limit:
            turns.append(await run_turn(session, url, model, convo, turn, w))

    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        for turn in range(w.turns):
            await asyncio.gather(*(one(session, convo, turn) for convo in convos))
    return turns, time.perf_counter() - start


@dataclass(frozen=True)
class Summary:
    config: str
    turns: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    prefill_tokens: int  # prompt tokens computed: neither in the prefix cache nor loaded from a tier
    cached_tokens: int
    output_tokens: int
    wall_seconds: float
    host_hits: int  # blocks loaded from each tier (GET /status)
    disk_hits: int

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def turns_per_second(self) -> float:
        return self.turns / self.wall_seconds if self.wall_seconds else 0.0


def summarise(config: str, turns: list[Turn], wall: float, status: dict) -> Summary:
    good = [t for t in turns if t.error is None and t.ttft is not None]
    ttfts = [t.ttft for t in good]
    tiers = status.get("kv_tiers") or {}
    return Summary(config, len(turns), len(turns) - len(good),
                   percentile(ttfts, 50), percentile(ttfts, 90),
                   sum(t.prompt_tokens - t.cached_tokens for t in good), sum(t.cached_tokens for t in good),
                   sum(t.output_tokens for t in good), wall,
                   (tiers.get("host") or {}).get("hits", 0), (tiers.get("disk") or {}).get("hits", 0))


def server_flags(config: str, tiers: Tiers, disk_dir: str) -> list[str]:
    flags = ["--kv-cache-memory", tiers.kv_cache_memory]
    if config in ("host", "host+disk"):
        flags += ["--kv-host-size", tiers.kv_host_size]
    if config == "host+disk":
        flags += ["--kv-disk-dir", disk_dir, "--kv-disk-size", tiers.kv_disk_size]
    return flags


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


def measure(config: str, w: Workload, tiers: Tiers, extra: list[str]) -> tuple[Summary, list[Turn]]:
    """One configuration on a fresh server: its summary and every turn."""
    disk_dir = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    proc, url = start_server(server_flags(config, tiers, disk_dir) + extra)
    try:
        model = get_json(url + "/v1/models")["data"][0]["id"]
        turns, wall = asyncio.run(run_workload(url, model, w))
        time.sleep(1.0)  # the decode actor's stats reach /status with its next heartbeat
        status = get_json(url + "/status")
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return summarise(config, turns, wall, status), turns


def print_table(rows: list[Summary]) -> None:
    print("config      turns  errors  TTFT p50 s  TTFT p90 s  prefill tok  cached tok  host blk  disk blk  "
          "wall s  out tok/s  turns/s")
    for s in rows:
        print(f"{s.config:<10}  {s.turns:>5}  {s.errors:>6}  {s.ttft_p50:>10.3f}  {s.ttft_p90:>10.3f}  "
              f"{s.prefill_tokens:>11}  {s.cached_tokens:>10}  {s.host_hits:>8}  {s.disk_hits:>8}  "
              f"{s.wall_seconds:>6.1f}  {s.output_tokens_per_second:>9.1f}  {s.turns_per_second:>7.2f}")
    base = next((s for s in rows if s.config == "none"), None)
    for s in rows:
        if base is not None and s is not base and s.ttft_p50 > 0:
            print(f"{s.config}: TTFT p50 {base.ttft_p50 / s.ttft_p50:.1f}x lower than none "
                  f"(goal: at least 3x), prefill tokens {base.prefill_tokens / max(s.prefill_tokens, 1):.1f}x fewer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d, t = Workload(), Tiers()
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--documents", type=int, default=d.documents)
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="about this many tokens per document")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens of each answer")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="turns in flight at once")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--kv-cache-memory", default=t.kv_cache_memory, help="the KV pool of the decode actor")
    p.add_argument("--kv-host-size", default=t.kv_host_size)
    p.add_argument("--kv-disk-size", default=t.kv_disk_size)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M)")
    p.add_argument("--server-flags", default="", help="more `cli.py serve` flags, e.g. '--threads 2'")
    p.add_argument("--json", default=None, help="write the summaries and every turn to this file")
    p.add_argument("--quick", action="store_true", help="a small run that only checks the bench works")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    return args


def settings(args: argparse.Namespace) -> tuple[Workload, Tiers]:
    if args.quick:
        return replace(QUICK, seed=args.seed), QUICK_TIERS
    return (Workload(args.conversations, args.turns, args.documents, args.doc_tokens, args.max_tokens,
                     args.concurrency, args.seed), Tiers(args.kv_cache_memory, args.kv_host_size, args.kv_disk_size))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    origin = provenance("kv_tiers", argv)
    workload, tiers = settings(args)
    extra = (["--model", args.model] if args.model else []) + args.server_flags.split()
    results = [measure(config, workload, tiers, extra) for config in args.configs]
    rows = [summary for summary, _ in results]
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**origin, "workload": asdict(workload), "tiers": asdict(tiers),
             "summaries": [asdict(s) | {"output_tokens_per_second": s.output_tokens_per_second,
                                         "turns_per_second": s.turns_per_second} for s in rows],
             "turns": {s.config: [asdict(t) for t in turns] for s, (_, turns) in zip(rows, results)}}, indent=2))
    return 1 if any(s.errors for s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
