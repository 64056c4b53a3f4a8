"""A long prompt, short chats arriving during its prefill, and streams decoding through it: on `cli.py serve`,
for one or two checkouts in one run.

    python -m bench.stall_free [--long-len 6500] [--streams 4] [--chat-every 0.5] [--base COMMIT]
        [--server-flags FLAGS] [--json OUT]

Per checkout (this one, and with --base the given commit in a temporary git worktree, served alternately):
1. alone: the long prompt (--long-len token ids, one output token) on an idle server: its TTFT alone; and the
   decoding streams alone: their inter-token latency (ITL) without the long prompt;
2. mixed: --streams streams decode (EOS ignored), then the long prompt is sent, then a 12-token chat every
   --chat-every seconds until the long prompt's first token arrives.
It prints the chats' TTFT p50 / p99 (goal: p99 at most 1 s), the decoding streams' ITL p99 while the long
prompt prefilled against their ITL p99 alone (goal: at most 3x), and the long prompt's TTFT against its TTFT
alone (goal: at most 1.3x). One server at a time; the model is the server's default unless --server-flags
names another.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from bench.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
WORDS = "harbour lantern meadow copper violin desert orbit candle thunder silver".split()
CHAT = "Name one colour of the sky."  # about 12 tokens with the chat template's own


@dataclass(frozen=True)
class Result:
    label: str
    long_ttft_alone: float
    itl_p99_alone: float
    long_ttft_mixed: float
    itl_p99_mixed: float
    chat_ttft_p50: float
    chat_ttft_p99: float
    chats: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@contextmanager
def server(cwd: Path, flags: list[str]) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "cli.py", "serve", "--port", "0", "--log-level", "info", *flags],
                            cwd=cwd, stderr=subprocess.PIPE, text=True, env=_env(cwd))
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"serving .* on (http://\S+)", line)
            if found:
                threading.Thread(target=proc.stderr.read, daemon=True).start()
                yield found.group(1)
                return
        raise RuntimeError(f"the server in {cwd} exited ({proc.wait()}) before it served:\n" + "".join(lines[-20:]))
    finally:
        proc.terminate()
        proc.wait(60)


def _env(cwd: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(cwd)}


def long_prompt(length: int) -> list[int]:
    """Distinct token ids well inside every vocabulary, never a prefix-cache hit across runs."""
    seed = time.monotonic_ns() % 1000
    return [100 + (seed + 37 * i) % 20000 for i in range(length)]


async def ttft(client, model: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, stream=True)
    async for _ in stream:
        return time.perf_counter() - start
    return time.perf_counter() - start


async def chat_ttft(client, model: str) -> float:
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}],
                                                  max_tokens=8, temperature=0, stream=True)
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def decode_stream(client, model: str, index: int, stop: asyncio.Event, stamps: list[float]) -> None:
    """Decodes until `stop`, appending each text chunk's arrival time."""
    prompt = f"Story {index}: " + " ".join(WORDS[(index + j) % len(WORDS)] for j in range(20))
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=4000, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if stop.is_set():
            await stream.close()
            return


def gaps_within(stamps: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:]) if start <= b <= end]


async def itl_alone(client, model: str, streams: int, seconds: float = 6.0) -> float:
    stop, stamps = asyncio.Event(), [[] for _ in range(streams)]
    tasks = [asyncio.create_task(decode_stream(client, model, i, stop, stamps[i])) for i in range(streams)]
    await asyncio.sleep(2.0)  # past their prefills
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    end = time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    return percentile([g for s in stamps for g in gaps_within(s, start, end)], 99)


async def mixed(client, model: str, args: argparse.Namespace) -> tuple[float, float, list[float]]:
    """-> (long prompt's TTFT, decoding streams' ITL p99 during its prefill, chats' TTFTs)."""
    stop, stamps = asyncio.Event(), [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(decode_stream(client, model, i, stop, stamps[i])) for i in range(args.streams)]
    await asyncio.sleep(2.0)
    start = time.perf_counter()
    long_task = asyncio.create_task(ttft(client, model, long_prompt(args.long_len)))
    chats = []
    while not long_task.done():
        chats.append(asyncio.create_task(chat_ttft(client, model)))
        await asyncio.sleep(args.chat_every)
    long_ttft = await long_task
    chat_ttfts = list(await asyncio.gather(*chats))
    stop.set()
    await asyncio.gather(*tasks)
    gaps = [g for s in stamps for g in gaps_within(s, start, start + long_ttft)]
    return long_ttft, percentile(gaps, 99), chat_ttfts


async def measure(url: str, label: str, args: argparse.Namespace) -> Result:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        await ttft(client, model, long_prompt(64))  # warm-up
        alone = await ttft(client, model, long_prompt(args.long_len))
        itl = await itl_alone(client, model, args.streams)
        long_mixed, itl_mixed, chats = await mixed(client, model, args)
    return Result(label, alone, itl, long_mixed, itl_mixed, statistics.median(chats), percentile(chats, 99),
                  len(chats))


@contextmanager
def checkout(commit: str | None) -> Iterator[Path]:
    if commit is None:
        yield ROOT
        return
    with tempfile.TemporaryDirectory(prefix="stall-free-") as tmp:
        path = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), commit], cwd=ROOT, check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=True)


def print_table(results: list[Result]) -> None:
    print("label        long TTFT alone  mixed  ratio | ITL p99 alone  during  ratio | chats  TTFT p50    p99")
    for r in results:
        print(f"{r.label:<12} {r.long_ttft_alone:>14.2f}s {r.long_ttft_mixed:>5.2f}s "
              f"{r.long_ttft_mixed / r.long_ttft_alone:>5.2f} | {r.itl_p99_alone * 1e3:>11.1f}ms "
              f"{r.itl_p99_mixed * 1e3:>6.0f}ms {r.itl_p99_mixed / r.itl_p99_alone:>6.1f} | {r.chats:>5} "
              f"{r.chat_ttft_p50:>8.2f}s {r.chat_ttft_p99:>6.2f}s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-len", type=int, default=6500)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--chat-every", type=float, default=0.5)
    p.add_argument("--base", default=None, help="also serve this commit (a git worktree), before this checkout")
    p.add_argument("--server-flags", default="")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    flags = args.server_flags.split()
    results = []
    runs = ([(f"base {args.base[:7]}", args.base)] if args.base else []) + [("this", None)]
    for label, commit in runs:
        with checkout(commit) as path, server(path, flags) as url:
            results.append(asyncio.run(measure(url, label, args)))
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance("stall_free", argv), "args": vars(args),
                                               "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
