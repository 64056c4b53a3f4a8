"""Kill campaign: streaming clients against `serve` while its actors are killed with SIGKILL.

    python -m bench.recovery [--clients 32] [--seconds 60] [--kills decode@15,prefill@30,decode@45]
        [--max-tokens 96] [--model PATH] [--dtype float32] [-- extra serve flags]

The server runs with one prefill and one decode actor (fp32, so greedy text does not depend on what shares a
batch). Before the campaign each prompt's greedy answer is taken once, whole. Then every client streams
requests back to back for --seconds, and at each --kills time the named actor's process gets SIGKILL. Each
stream ends as one of:

- ok: [DONE] with the reference text;      - wrong: [DONE] with any other text;
- cut: tokens streamed, then an error event or a broken connection;
- lost: refused or failed before its first token;   - hung: no end within --deadline seconds.

After each kill: the seconds until that actor serves again (the supervisor's "serving again" log line) and
until /health answers 200, and the new process's start-up stages (its "ready ... in" log line).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.load_test import PROMPTS, chunk_text

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("ok", "cut", "lost", "hung", "wrong")


@dataclass(frozen=True)
class Kill:
    role: str
    at: float


@dataclass
class KillResult:
    kill: Kill
    pid: int
    serving_again: float | None = None  # kill -> the supervisor's "serving again" line
    healthy: float | None = None  # kill -> /health 200 with every actor ready
    startup: str = ""


@dataclass
class ServerLog:
    """The server's stderr, read on a thread so that a full pipe never blocks it."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    def follow(self, stream) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line))

    def after(self, since: float, pattern: str) -> tuple[float, str] | None:
        for stamp, line in list(self.lines):
            if stamp >= since and re.search(pattern, line):
                return stamp, line
        return None


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str, ServerLog]:
    proc = subprocess.Popen([sys.executable, "cli.py", "serve", "--port", "0", "--log-level", "info",
                             "--log-format", "json", *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    log = ServerLog()
    for line in proc.stderr:
        log.lines.append((time.monotonic(), line))
        found = re.search(r"serving .* on (http://\S+?)[ \"]", line)
        if found:
            threading.Thread(target=log.follow, args=(proc.stderr,), daemon=True).start()
            return proc, found.group(1), log
    raise RuntimeError(f"the server exited ({proc.wait()}) before it served")


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def reference_texts(session: aiohttp.ClientSession, url: str, max_tokens: int) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        async with session.post(url + "/v1/completions", json=body(prompt, max_tokens, False)) as r:
            out[prompt] = (await r.json())["choices"][0]["text"]
    return out


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(outcome without the text check, streamed text)."""
    text, started = [], False
    try:
        async with session.post(url + "/v1/completions", json=body(prompt, max_tokens, True)) as r:
            if r.status != 200:
                return "lost", ""
            async for raw in r.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    return "done", "".join(text)
                if not line.startswith(b"data:"):
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return ("cut" if started else "lost"), "".join(text)
                piece = chunk_text(chunk)
                started |= bool(piece)
                text.append(piece)
    except (aiohttp.ClientError, ValueError):
        pass
    return ("cut" if started else "lost"), "".join(text)


async def client(session, url: str, index: int, stop_at: float, args, refs: dict[str, str],
                 tally: Counter) -> None:
    i = index
    while time.monotonic() < stop_at:
        prompt = PROMPTS[i % len(PROMPTS)]
        i += 1
        try:
            outcome, text = await asyncio.wait_for(one_stream(session, url, prompt, args.max_tokens), args.deadline)
        except asyncio.TimeoutError:
            outcome, text = "hung", ""
        if outcome == "done":
            outcome = "ok" if text == refs[prompt] else "wrong"
        tally[outcome] += 1
        if outcome == "lost":
            await asyncio.sleep(0.2)  # a refused request: do not spin while the server recovers


async def status(session, url: str) -> dict:
    async with session.get(url + "/status") as r:
        return await r.json()


async def healthy(session, url: str) -> bool:
    try:
        async with session.get(url + "/health") as r:
            if r.status != 200:
                return False
        return all(a["state"] == "ready" for a in (await status(session, url))["actors"])
    except aiohttp.ClientError:
        return False


async def kill_at(session, url: str, kill: Kill, start: float, log: ServerLog) -> KillResult:
    await asyncio.sleep(max(0.0, start + kill.at - time.monotonic()))
    actor = next(a for a in (await status(session, url))["actors"] if a["role"] == kill.role)
    killed_at = time.monotonic()
    signal.pthread_kill  # noqa: B018 - signals below go to another process
    import os
    os.kill(actor["pid"], signal.SIGKILL)
    result = KillResult(kill, actor["pid"])
    await asyncio.sleep(0.3)
    while time.monotonic() - killed_at < 120:
        if result.healthy is None and await healthy(session, url):
            result.healthy = time.monotonic() - killed_at
        back = log.after(killed_at, rf"actor {actor['id']} serving again")
        if back and result.serving_again is None:
            result.serving_again = back[0] - killed_at
        if result.healthy is not None and result.serving_again is not None:
            break
        await asyncio.sleep(0.1)
    ready = log.after(killed_at, rf"actor {actor['id']} \(\w+\) ready on .* in ")
    if ready:
        result.startup = json.loads(ready[1]).get("startup", "")
    return result


async def campaign(url: str, args, log: ServerLog) -> tuple[Counter, list[KillResult]]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.deadline)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        refs = await reference_texts(session, url, args.max_tokens)
        tally: Counter = Counter()
        start = time.monotonic()
        stop_at = start + args.seconds
        kills = [asyncio.create_task(kill_at(session, url, k, start, log)) for k in args.kills]
        await asyncio.gather(*(client(session, url, i, stop_at, args, refs, tally) for i in range(args.clients)))
        return tally, await asyncio.gather(*kills)


def parse_kills(text: str) -> list[Kill]:
    kills = []
    for item in filter(None, text.split(",")):
        role, at = item.split("@")
        kills.append(Kill(role, float(at)))
    return kills


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--kills", type=parse_kills, default=parse_kills("decode@15,prefill@30,decode@45"))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds after which a stream counts as hung")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    flags = ["--prefill-actors", "1", "--decode-actors", "1", "--dtype", args.dtype, *extra]
    if args.model:
        flags += ["--model", args.model]
    proc, url, log = start_server(flags)
    try:
        tally, kills = asyncio.run(campaign(url, args, log))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"{args.clients} streaming clients for {args.seconds:.0f}s, max_tokens {args.max_tokens}, {url}")
    print("streams: " + "  ".join(f"{o} {tally[o]}" for o in OUTCOMES) + f"  (total {sum(tally.values())})")
    print(f"{'kill':<16}{'serving again s':>16}{'healthy s':>12}  start-up stages of the replacement (s)")
    for k in kills:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{k.kill.role + '@' + str(k.kill.at):<16}{fmt(k.serving_again):>16}{fmt(k.healthy):>12}  {k.startup}")
    return 0 if tally["cut"] + tally["lost"] + tally["hung"] + tally["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
