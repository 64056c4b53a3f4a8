"""Online load test: N concurrent streaming clients against a running server.

    python -m bench.load_test --url http://127.0.0.1:8000 --concurrency 64 --requests 128 --max-tokens 64
        [--endpoint chat|completions] [--responses-share F] [--prompt TEXT] [--api-key KEY] [--json OUT]

Each client sends streaming requests one after another (greedy, EOS ignored, so every request produces exactly
--max-tokens tokens) until --requests have been sent in total. TTFT is measured from sending the request to the
first chunk with text; ITL is the gap between consecutive chunks with text (a chunk can carry more than one
token when the detokeniser holds back an incomplete character, so ITL is per chunk). Output tokens come from
the server's usage chunk. --json OUT writes the report, every request's TTFT and chunk gaps, the command line and
the start time (what `python -m bench.report` reads).

--responses-share F sends that share of the requests (spread evenly through the run) to /v1/responses instead,
streamed as typed events, with the same prompt, length and sampling: the cost of the Responses translation and
its events against chat, e.g. `--concurrency 32 --requests 256 --responses-share 0.5` against the same run with
0. A Responses stream's text is its response.output_text.delta events, its tokens the final response's usage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from bench.provenance import provenance

PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
           "List some uses for a paperclip.", "Describe the water cycle to a child.",
           "What makes a good cup of tea?", "Summarise the rules of chess in a few lines.")


@dataclass(frozen=True)
class LoadConfig:
    url: str
    concurrency: int = 64
    requests: int = 128
    max_tokens: int = 64
    endpoint: str = "chat"
    prompt: str | None = None
    api_key: str | None = None
    timeout: float = 600.0
    responses_share: float = 0.0  # the share of requests sent to /v1/responses instead

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.requests < 1 or self.max_tokens < 1:
            raise ValueError("concurrency, requests and max_tokens must be at least 1")
        if not 0.0 <= self.responses_share <= 1.0:
            raise ValueError(f"responses_share must be between 0 and 1, got {self.responses_share}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")


@dataclass
class RequestResult:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    path: str = ""  # the route the request went to


@dataclass(frozen=True)
class Report:
    requests: int
    errors: int
    wall_seconds: float
    requests_per_second: float
    output_tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    latency_p50: float
    first_errors: tuple[str, ...]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def via_responses(cfg: LoadConfig, index: int) -> bool:
    """Whether request `index` goes to /v1/responses: the share spread evenly (0.5: every second request)."""
    return int((index + 1) * cfg.responses_share) > int(index * cfg.responses_share)


def request_body(cfg: LoadConfig, index: int) -> tuple[str, dict]:
    prompt = cfg.prompt or PROMPTS[index % len(PROMPTS)]
    if via_responses(cfg, index):
        return "/v1/responses", {"input": prompt, "max_output_tokens": cfg.max_tokens, "temperature": 0,
                                 "ignore_eos": True, "stream": True, "store": False}
    common = {"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


def chunk_text(chunk: dict) -> str:
    if chunk.get("type") == "response.output_text.delta":
        return chunk["delta"]
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def chunk_output_tokens(chunk: dict) -> int | None:
    """The output tokens a chunk reports: a chat or completions usage chunk, or a Responses stream's final
    response; None for the others."""
    if chunk.get("usage"):
        return chunk["usage"]["completion_tokens"]
    usage = (chunk.get("response") or {}).get("usage")
    return usage["output_tokens"] if usage else None


def chunk_error(chunk: dict) -> str | None:
    if "error" in chunk and isinstance(chunk["error"], dict):
        return chunk["error"].get("message")
    if chunk.get("type") == "error":
        return chunk.get("message")
    return None


async def _read_stream(response: aiohttp.ClientResponse, result: RequestResult, sent: float) -> None:
    last = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        error = chunk_error(chunk)
        if error is not None:
            raise RuntimeError(f"stream error: {error}")
        tokens = chunk_output_tokens(chunk)
        if tokens is not None:
            result.output_tokens = tokens
        if chunk_text(chunk):
            now = time.perf_counter()
            result.ttft = now - sent if result.ttft is None else result.ttft
            if last is not None:
                result.itls.append(now - last)
            last = now


async def one_request(session: aiohttp.ClientSession, cfg: LoadConfig, index: int) -> RequestResult:
    path, body = request_body(cfg, index)
    result = RequestResult(ok=False, path=path)
    sent = time.perf_counter()
    try:
        async with session.post(cfg.url.rstrip("/") + path, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            await _read_stream(response, result, sent)
        result.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - sent
    return result


async def _worker(session: aiohttp.ClientSession, cfg: LoadConfig, indices: asyncio.Queue,
                  results: list[RequestResult]) -> None:
    while not indices.empty():
        results.append(await one_request(session, cfg, indices.get_nowait()))


async def run_load(cfg: LoadConfig) -> Report:
    return summarise(*await run_requests(cfg))


async def run_requests(cfg: LoadConfig) -> tuple[list[RequestResult], float]:
    """Every request's result and the wall time of the whole run."""
    indices: asyncio.Queue = asyncio.Queue()
    for i in range(cfg.requests):
        indices.put_nowait(i)
    results: list[RequestResult] = []
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=cfg.concurrency)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        started = time.perf_counter()
        await asyncio.gather(*(_worker(session, cfg, indices, results) for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - started
    return results, wall


def summarise(results: list[RequestResult], wall: float) -> Report:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    errors = tuple(r.error for r in results if not r.ok)
    return Report(len(results), len(errors), wall, len(ok) / wall, sum(r.output_tokens for r in ok) / wall,
                  percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99),
                  percentile([r.latency for r in ok], 50), errors[:5])


def format_report(cfg: LoadConfig, report: Report) -> str:
    routes = cfg.endpoint if not cfg.responses_share else f"{cfg.endpoint}, {cfg.responses_share:g} on responses"
    lines = [f"{cfg.requests} requests ({routes}, {cfg.max_tokens} tokens each) at concurrency "
             f"{cfg.concurrency} against {cfg.url}",
             f"  wall time        {report.wall_seconds:8.2f} s",
             f"  requests/s       {report.requests_per_second:8.2f}",
             f"  output tokens/s  {report.output_tokens_per_second:8.1f}",
             f"  TTFT p50 / p99   {report.ttft_p50 * 1e3:8.1f} / {report.ttft_p99 * 1e3:.1f} ms",
             f"  ITL  p50 / p99   {report.itl_p50 * 1e3:8.1f} / {report.itl_p99 * 1e3:.1f} ms",
             f"  latency p50      {report.latency_p50:8.2f} s",
             f"  errors           {report.errors:8d}"]
    return "\n".join(lines + [f"    {e}" for e in report.first_errors])


def parse_args(argv: list[str] | None) -> tuple[LoadConfig, str | None]:
    p = argparse.ArgumentParser(prog="python -m bench.load_test", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--responses-share", type=float, default=0.0,
                   help="the share of requests sent to /v1/responses instead (0..1, spread evenly)")
    p.add_argument("--prompt", default=None, help="one prompt for every request (default: a rotating set)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    args = p.parse_args(argv)
    cfg = LoadConfig(args.url, args.concurrency, args.requests, args.max_tokens, args.endpoint, args.prompt,
                     args.api_key, responses_share=args.responses_share)
    return cfg, args.json


def result_json(cfg: LoadConfig, report: Report, results: list[RequestResult], origin: dict) -> dict:
    """The report with every request's samples (TTFT, chunk gaps) for `python -m bench.report`'s CDFs;
    `origin` is the provenance taken when the run started."""
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    return {**origin, "config": config, "report": asdict(report),
            "requests": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    cfg, json_path = parse_args(argv)
    origin = provenance("load_test", argv)
    results, wall = asyncio.run(run_requests(cfg))
    report = summarise(results, wall)
    print(format_report(cfg, report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result_json(cfg, report, results, origin), f, indent=2)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
