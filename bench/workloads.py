"""Quadrant workloads (SISO / LISO / SILO / LILO) against any OpenAI-compatible streaming server.

    python -m bench.workloads --url http://127.0.0.1:8000 --mix chat --rate 1 --num-requests 8
    python -m bench.workloads --mix chat+liso-bursts --rates 0.5,1,2,4 --duration 60 \
        --compare never=http://127.0.0.1:8001,always=http://127.0.0.1:8002,auto=http://127.0.0.1:8003
    python -m bench.workloads --itl-under-bursts --streams 8 --burst-every 10 --duration 60

Every request is a streaming `POST /v1/completions` (greedy, `ignore_eos` so that it produces exactly
`max_tokens` tokens, `stream_options.include_usage`). Lengths come from the four quadrants of DESIGN.md section 1,
scaled to the served context (`max_model_len` from `/v1/models`, else `--context`). Prompts are English-like text
generated from a built-in word list and grammar (deterministic per seed and request), cut to a token count that is
either estimated (1.3 tokens per word) or exact with `--tokenizer path/to/tokenizer.json`; the report says which
and compares the target with the prompt tokens the server reports.

Definitions. TTFT: request sent -> first chunk with text. ITL: gap between successive chunks with text (a chunk may
carry more than one token). TPOT: (end of stream - first token) / (output tokens - 1). SLO attainment: the fraction
of requests (errors count as misses) with TTFT <= --slo-ttft and TPOT <= --slo-tpot. Goodput (DistServe): the
highest request rate whose attainment is >= --slo-target (0.9), from a sweep of --rates, each rate a separate
run against the same server; reported as the highest passing rate tested and linearly interpolated to the
crossing. Percentiles interpolate linearly between samples (numpy's default).

Same seed, same requests: rerunning against a server that keeps its prefix cache reuses the cached prompts; change
--seed between runs against the same server process (the rates of one sweep already get different texts).

Bounded: arrivals stop after --duration seconds or --num-requests; every request has a --timeout; nothing but the
given URLs is contacted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp
import numpy as np

from bench.provenance import provenance

QUADRANTS = ("siso", "liso", "silo", "lilo")
TOKENS_PER_WORD = 1.3
SHORT_IN = (16, 128)
SHORT_OUT = (8, 32)
LONG_OUT = (128, 512)
PROMPT_SAFETY = 0.8  # the longest prompt leaves room for the longest output, with slack for the token estimate

NAMED_MIXES: Mapping[str, str] = MappingProxyType({
    "chat": "siso=0.7,silo=0.3",
    "chat+liso-bursts": "siso=1+liso-bursts",
    "all": "siso=0.25,liso=0.25,silo=0.25,lilo=0.25",
})

# ------------------------------------------------------------------------------------------------ prompt text
# A small English vocabulary and sentence grammar (written for this module); text is drawn from it with a seeded
# generator, so every prompt is different (no accidental prefix-cache hits) and reproducible.
_WORDS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "adj": ("quiet", "old", "bright", "narrow", "heavy", "careful", "distant", "green", "small", "patient", "broken",
            "warm", "early", "crowded", "simple", "curious", "steady", "wooden", "northern", "busy", "gentle",
            "empty", "ancient", "sudden", "clever", "pale", "loud", "honest", "strange", "tired"),
    "noun": ("river", "teacher", "market", "engine", "garden", "letter", "bridge", "farmer", "lantern", "harbour",
             "village", "clock", "student", "window", "mountain", "library", "baker", "storm", "road", "painter",
             "island", "kitchen", "doctor", "forest", "train", "council", "ship", "child", "mill", "report"),
    "verb": ("watches", "carries", "follows", "repairs", "finds", "describes", "remembers", "builds", "opens",
             "leaves", "crosses", "measures", "answers", "visits", "paints", "guards", "collects", "explains",
             "reaches", "questions"),
    "verb_i": ("waits", "sleeps", "returns", "hesitates", "listens", "wanders", "arrives", "works", "rests",
               "changes", "grows", "disappears"),
    "adv": ("slowly", "quietly", "again", "carefully", "at last", "every morning", "without a word", "once more",
            "before dawn", "in silence", "each winter", "for a while"),
    "prep": ("near", "behind", "across", "beside", "under", "beyond", "inside", "along", "above", "around"),
    "conj": ("and", "but", "while", "because", "although", "so", "until", "after"),
})
_TEMPLATES = (
    "the {adj} {noun} {verb} the {noun} {prep} the {noun}",
    "{adv}, the {noun} {verb} a {adj} {noun}",
    "a {adj} {noun} {verb_i} {prep} the {adj} {noun} {conj} the {noun} {verb_i} {adv}",
    "the {noun} {prep} the {noun} {verb_i} {adv}",
    "nobody {verb} the {adj} {noun} {conj} the {noun} {verb} it {adv}",
    "the {noun} and the {noun} {verb_i} {prep} the {adj} {noun}",
    "when the {noun} {verb_i}, the {adj} {noun} {verb} the {noun}",
)
_SLOT = re.compile(r"\{(\w+)\}")


def _sentence(rng: np.random.Generator) -> str:
    template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
    text = _SLOT.sub(lambda m: _pick(rng, _WORDS[m.group(1)]), template)
    return text[0].upper() + text[1:] + "."


def _pick(rng: np.random.Generator, pool: Sequence[str]) -> str:
    return pool[int(rng.integers(len(pool)))]


def english_words(rng: np.random.Generator, n_words: int) -> list[str]:
    """At least n_words words of generated English prose (whole sentences), as a word list."""
    words: list[str] = []
    while len(words) < n_words:
        words.extend(_sentence(rng).split())
    return words


def estimated_words(n_tokens: int, tokens_per_word: float = TOKENS_PER_WORD) -> int:
    return max(1, round(n_tokens / tokens_per_word))


class PromptMaker:
    """Prompt text of about n tokens: exact when given a `tokenizers` tokenizer file, else estimated per word."""

    def __init__(self, tokenizer_path: str | None = None, tokens_per_word: float = TOKENS_PER_WORD) -> None:
        if not tokens_per_word > 0:
            raise ValueError(f"tokens per word must be > 0, got {tokens_per_word}")
        self._tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        self._tokens_per_word = tokens_per_word
        self.method = (f"exact, tokenised with {tokenizer_path}" if tokenizer_path
                       else f"estimated at {tokens_per_word:g} tokens per word (no --tokenizer)")

    def make(self, key: Sequence[int], n_tokens: int) -> str:
        rng = np.random.default_rng([*key, n_tokens])
        if self._tokenizer is None:
            n_words = estimated_words(n_tokens, self._tokens_per_word)
            return " ".join(english_words(rng, n_words)[:n_words])
        return self._cut_to_tokens(rng, n_tokens)

    def _cut_to_tokens(self, rng: np.random.Generator, n_tokens: int) -> str:
        words = english_words(rng, n_tokens)  # at least one token per word, so this is long enough
        text = " ".join(words)
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= n_tokens:
            return text
        return text[:encoding.offsets[n_tokens - 1][1]]


def _load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer  # only with --tokenizer
    file = Path(path)
    return Tokenizer.from_file(str(file / "tokenizer.json" if file.is_dir() else file))


# ------------------------------------------------------------------------------------------------ quadrants
@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"bad length range [{self.lo}, {self.hi}]")

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.lo, self.hi + 1))


@dataclass(frozen=True)
class QuadrantSpec:
    name: str
    prompt: LengthRange
    output: LengthRange


def quadrant_specs(context: int, max_long_in: int = 2048, max_long_out: int = 512) -> dict[str, QuadrantSpec]:
    """Length ranges of the four quadrants for a model with this context length.

    Long prompts are U[ctx/4, ctx/2]; when --max-long-in caps the top, the bottom becomes half the cap so that the
    lengths still spread (ctx 8192, cap 2048 -> U[1024, 2048]). Long outputs are U[128, 512] capped by
    --max-long-out. The longest prompt plus the longest output always fit the context."""
    short_in, short_out = LengthRange(*SHORT_IN), LengthRange(*SHORT_OUT)
    long_out = _long_out_range(max_long_out)
    long_in = _long_in_range(context, max_long_in, long_out.hi)
    return {"siso": QuadrantSpec("siso", short_in, short_out), "liso": QuadrantSpec("liso", long_in, short_out),
            "silo": QuadrantSpec("silo", short_in, long_out), "lilo": QuadrantSpec("lilo", long_in, long_out)}


def _long_out_range(max_long_out: int) -> LengthRange:
    hi = min(LONG_OUT[1], max_long_out)
    if hi <= SHORT_OUT[1]:
        raise ValueError(f"--max-long-out must exceed the short outputs' {SHORT_OUT[1]} tokens, got {max_long_out}")
    return LengthRange(min(LONG_OUT[0], hi), hi)


def _long_in_range(context: int, max_long_in: int, long_out_hi: int) -> LengthRange:
    hi = min(context // 2, max_long_in, int(PROMPT_SAFETY * (context - long_out_hi)))
    lo = min(context // 4, hi // 2)
    if lo <= SHORT_IN[1]:
        raise ValueError(f"context {context} with --max-long-in {max_long_in} and --max-long-out {long_out_hi} "
                         f"leaves no long prompts above the short ones ({SHORT_IN[1]} tokens)")
    return LengthRange(lo, hi)


# ------------------------------------------------------------------------------------------------ mixes
@dataclass(frozen=True)
class Mix:
    weights: tuple[tuple[str, float], ...]  # quadrant, probability (sums to 1)
    burst_quadrant: str | None = None
    label: str = ""


def parse_mix(spec: str) -> Mix:
    """`siso=0.8,liso=0.2`, a bare quadrant (`silo`), a named mix (chat, all, chat+liso-bursts), optionally
    followed by `+QUADRANT-bursts` (bursts of that quadrant on top of the base Poisson stream)."""
    text = spec.strip().lower()
    text = NAMED_MIXES.get(text, text)
    base, *extras = text.split("+")
    if len(extras) > 1:
        raise ValueError(f"mix {spec!r}: at most one '+QUADRANT-bursts' part")
    base = NAMED_MIXES.get(base.strip(), base)
    burst = _parse_burst(extras[0], spec) if extras else None
    return Mix(_parse_weights(base, spec), burst, spec.strip())


def _parse_burst(part: str, spec: str) -> str:
    match = re.fullmatch(r"\s*(\w+)-bursts\s*", part)
    if not match or match.group(1) not in QUADRANTS:
        raise ValueError(f"mix {spec!r}: expected '+QUADRANT-bursts' with QUADRANT in {QUADRANTS}, got {part!r}")
    return match.group(1)


def _parse_weights(text: str, spec: str) -> tuple[tuple[str, float], ...]:
    weights: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        name, value = _parse_weight(item, spec)
        if name in weights:
            raise ValueError(f"mix {spec!r}: {name} given twice")
        weights[name] = value
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mix {spec!r}: the weights sum to zero")
    return tuple((name, weights[name] / total) for name in QUADRANTS if weights.get(name, 0.0) > 0)


def _parse_weight(item: str, spec: str) -> tuple[str, float]:
    name, sep, value = item.partition("=")
    name = name.strip()
    if name not in QUADRANTS:
        known = ", ".join(QUADRANTS + tuple(NAMED_MIXES))
        raise ValueError(f"mix {spec!r}: unknown quadrant or mix {name!r} (known: {known})")
    if not sep:
        return name, 1.0
    try:
        weight = float(value)
    except ValueError:
        raise ValueError(f"mix {spec!r}: weight of {name} is not a number: {value!r}") from None
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"mix {spec!r}: weight of {name} must be a finite number >= 0, got {value!r}")
    return name, weight


# ------------------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class RequestSpec:
    index: int
    quadrant: str
    arrival: float  # seconds after the run starts
    prompt_tokens: int  # target length
    max_tokens: int
    prompt: str
    burst: int | None = None  # burst number (1, 2, ...) for requests injected in bursts
    stream: int | None = None  # stream number for the steady streams of --itl-under-bursts


@dataclass(frozen=True)
class ArrivalPlan:
    rate: float
    duration: float | None = None
    count: int | None = None
    burst_every: float = 10.0
    burst_size: int = 2

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.duration is None and self.count is None:
            raise ValueError("give a duration or a request count")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"request count must be >= 1, got {self.count}")
        if not self.burst_every > 0 or self.burst_size < 1:
            raise ValueError("burst interval must be > 0 and burst size >= 1")


def poisson_arrivals(rng: np.random.Generator, rate: float, duration: float | None = None,
                     count: int | None = None) -> list[float]:
    """Arrival times of a Poisson process at `rate` per second, until `duration` or `count` (whichever first)."""
    if not rate > 0 or (duration is None and count is None):
        raise ValueError("poisson_arrivals needs rate > 0 and a duration or a count")
    times: list[float] = []
    t = 0.0
    while count is None or len(times) < count:
        t += float(rng.exponential(1.0 / rate))
        if duration is not None and t > duration:
            break
        times.append(t)
    return times


def burst_times(every: float, horizon: float) -> list[float]:
    """every, 2*every, ... strictly before horizon."""
    return [k * every for k in range(1, math.ceil(horizon / every)) if k * every < horizon]


def build_workload(mix: Mix, plan: ArrivalPlan, specs: Mapping[str, QuadrantSpec], prompts: PromptMaker,
                   seed: int) -> list[RequestSpec]:
    """The requests of one run, sorted by arrival; the same arguments give the same requests."""
    rng = np.random.default_rng([seed, 0])
    arrivals = poisson_arrivals(rng, plan.rate, plan.duration, plan.count)
    names = [name for name, _ in mix.weights]
    chosen = rng.choice(len(names), size=len(arrivals), p=[w for _, w in mix.weights]) if arrivals else []
    shapes: list[tuple[float, str, int | None]] = [(t, names[int(i)], None) for t, i in zip(arrivals, chosen)]
    if mix.burst_quadrant:
        horizon = plan.duration if plan.duration is not None else (arrivals[-1] if arrivals else 0.0)
        shapes += [(t, mix.burst_quadrant, k) for k, t in enumerate(burst_times(plan.burst_every, horizon), 1)
                   for _ in range(plan.burst_size)]
    shapes.sort(key=lambda s: s[0])
    salt = round(plan.rate * 1000)  # each rate of a sweep gets its own texts: no prefix-cache hits across runs
    return [_request(index, quadrant, t, specs[quadrant], prompts, (seed, 1, salt, index), burst, None)
            for index, (t, quadrant, burst) in enumerate(shapes)]


def _request(index: int, quadrant: str, arrival: float, spec: QuadrantSpec, prompts: PromptMaker,
             key: tuple[int, ...], burst: int | None, stream: int | None) -> RequestSpec:
    """One request whose lengths and text are drawn from a generator seeded with `key` alone."""
    rng = np.random.default_rng(key)
    n_in, n_out = spec.prompt.sample(rng), spec.output.sample(rng)
    return RequestSpec(index, quadrant, arrival, n_in, n_out, prompts.make(key, n_in), burst, stream)


# ------------------------------------------------------------------------------------------------ SSE parsing
class SseDecoder:
    """Incremental server-sent-events decoder: feed raw bytes, get the data payload of every complete event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, raw: bytes) -> list[str]:
        self._buffer += raw
        events: list[str] = []
        while (newline := self._buffer.find(b"\n")) >= 0:
            line, self._buffer = self._buffer[:newline].rstrip(b"\r"), self._buffer[newline + 1:]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: bytes) -> str | None:
        if not line:  # a blank line ends the event
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value[1:].decode() if value.startswith(b" ") else value.decode())
        return None  # comments (":...") and other fields (event, id, retry) are ignored


@dataclass(frozen=True)
class StreamEvent:
    text: str = ""
    usage: Mapping[str, Any] | None = None
    error: str | None = None
    done: bool = False


def parse_event(payload: str) -> StreamEvent:
    """One SSE data payload of an OpenAI completions / chat stream."""
    if payload.strip() == "[DONE]":
        return StreamEvent(done=True)
    try:
        chunk = json.loads(payload)
    except ValueError:
        return StreamEvent(error=f"unparseable stream chunk: {payload[:80]!r}")
    if not isinstance(chunk, dict):
        return StreamEvent(error=f"stream chunk is not an object: {payload[:80]!r}")
    if "error" in chunk:
        err = chunk["error"]
        return StreamEvent(error=f"stream error: {err.get('message') if isinstance(err, dict) else err}")
    usage = chunk.get("usage")
    return StreamEvent(text=_chunk_text(chunk), usage=usage if isinstance(usage, dict) else None)


def _chunk_text(chunk: Mapping[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


# ------------------------------------------------------------------------------------------------ records
@dataclass
class RequestRecord:
    server: str
    index: int
    quadrant: str
    arrival: float
    prompt_tokens_target: int
    max_tokens: int
    burst: int | None = None
    stream: int | None = None
    sent: float = 0.0
    prompt_tokens: int | None = None  # from the server's usage chunk
    output_tokens: int = 0  # usage, else the number of chunks with text
    usage_reported: bool = False
    token_times: list[float] = field(default_factory=list)  # seconds after the run start, chunks with text
    end: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: str | None = None
    http_status: int | None = None
    x_quadrant: str | None = None
    x_placement: str | None = None
    cut_off: bool = False  # a steady stream stopped by the end of the run (not an error, not in the summaries)


def itls(record: RequestRecord) -> list[float]:
    t = record.token_times
    return [b - a for a, b in zip(t, t[1:])]


def finish_record(record: RequestRecord, end: float) -> None:
    record.end = end
    record.e2e = end - record.sent
    if not record.usage_reported:
        record.output_tokens = len(record.token_times)
    if record.token_times:
        record.ttft = record.token_times[0] - record.sent
        if record.output_tokens > 1:
            record.tpot = (end - record.token_times[0]) / (record.output_tokens - 1)


# ------------------------------------------------------------------------------------------------ client
@dataclass(frozen=True)
class Target:
    name: str
    url: str


@dataclass(frozen=True)
class ClientOptions:
    model: str | None = None
    ignore_eos: bool = True
    timeout: float = 120.0


@dataclass(frozen=True)
class Clock:
    t0: float

    @staticmethod
    def start() -> Clock:
        return Clock(time.perf_counter())

    def now(self) -> float:
        return time.perf_counter() - self.t0


def request_body(spec: RequestSpec, opts: ClientOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": opts.ignore_eos}
    if opts.model:
        body["model"] = opts.model
    return body


def new_record(target: Target, spec: RequestSpec) -> RequestRecord:
    return RequestRecord(target.name, spec.index, spec.quadrant, spec.arrival, spec.prompt_tokens,
                         spec.max_tokens, spec.burst, spec.stream)


async def run_request(session: aiohttp.ClientSession, target: Target, opts: ClientOptions, spec: RequestSpec,
                      clock: Clock, stop: Callable[[], bool] | None = None) -> RequestRecord:
    record = new_record(target, spec)
    record.sent = clock.now()
    try:
        async with session.post(target.url.rstrip("/") + "/v1/completions", json=request_body(spec, opts),
                                timeout=aiohttp.ClientTimeout(total=opts.timeout)) as response:
            record.http_status = response.status
            record.x_quadrant = response.headers.get("X-Quadrant")
            record.x_placement = response.headers.get("X-Placement")
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                await _consume_stream(response, record, clock, stop)
    except asyncio.TimeoutError:
        record.error = f"timeout after {opts.timeout:g} s"
    except (aiohttp.ClientError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finish_record(record, clock.now())
    return record


async def _consume_stream(response: aiohttp.ClientResponse, record: RequestRecord, clock: Clock,
                          stop: Callable[[], bool] | None) -> None:
    decoder = SseDecoder()
    async for raw in response.content.iter_any():
        now = clock.now()
        for payload in decoder.feed(raw):
            if _apply_event(parse_event(payload), record, now):
                return
        if stop is not None and stop():
            record.cut_off = True
            return  # leaving the response closes the connection: the server aborts the request
    record.error = "stream ended without 'data: [DONE]'"


def _apply_event(event: StreamEvent, record: RequestRecord, now: float) -> bool:
    """Fold one event into the record; True when the stream is over."""
    if event.error:
        record.error = event.error
        return True
    if event.usage:
        record.prompt_tokens = event.usage.get("prompt_tokens")
        record.output_tokens = int(event.usage.get("completion_tokens") or 0)
        record.usage_reported = True
    if event.text:
        record.token_times.append(now)
    return event.done


def make_session(api_key: str | None) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)  # open loop: no cap


@dataclass(frozen=True)
class ServerInfo:
    model: str | None = None
    max_model_len: int | None = None
    error: str | None = None
    reachable: bool = True


async def discover(session: aiohttp.ClientSession, url: str) -> ServerInfo:
    """The first model of GET /v1/models and its max_model_len, when the server reports them."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return ServerInfo(error=f"GET /v1/models: HTTP {resp.status}")
            cards = (await resp.json()).get("data") or []
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        return ServerInfo(error=f"GET /v1/models: {type(exc).__name__}: {exc}", reachable=False)
    except (aiohttp.ClientError, ValueError) as exc:
        return ServerInfo(error=f"GET /v1/models: {type(exc).__name__}: {exc}")
    if not cards:
        return ServerInfo(error="GET /v1/models: no models listed")
    length = cards[0].get("max_model_len")
    return ServerInfo(cards[0].get("id"), int(length) if isinstance(length, int) and length > 0 else None)


async def run_schedule(target: Target, opts: ClientOptions, workload: Sequence[RequestSpec],
                       api_key: str | None) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (open loop); the records and the wall time."""
    async with make_session(api_key) as session:
        clock = Clock.start()
        records = await asyncio.gather(*(_fire(session, target, opts, spec, clock) for spec in workload))
        return list(records), clock.now()


async def _fire(session: aiohttp.ClientSession, target: Target, opts: ClientOptions, spec: RequestSpec,
                clock: Clock, stop: Callable[[], bool] | None = None) -> RequestRecord:
    await asyncio.sleep(max(0.0, spec.arrival - clock.now()))
    return await run_request(session, target, opts, spec, clock, stop)


# ------------------------------------------------------------------------------------------------ ITL under bursts
@dataclass(frozen=True)
class StreamsPlan:
    streams: int
    stream_quadrant: str
    burst_quadrant: str
    duration: float
    burst_every: float
    burst_size: int


def burst_specs(plan: StreamsPlan, specs: Mapping[str, QuadrantSpec], prompts: PromptMaker,
                seed: int) -> list[RequestSpec]:
    slots = [(t, k) for k, t in enumerate(burst_times(plan.burst_every, plan.duration), 1)
             for _ in range(plan.burst_size)]
    return [_request(index, plan.burst_quadrant, t, specs[plan.burst_quadrant], prompts, (seed, 3, index), k, None)
            for index, (t, k) in enumerate(slots)]


async def run_streams_with_bursts(target: Target, opts: ClientOptions, plan: StreamsPlan,
                                  specs: Mapping[str, QuadrantSpec], prompts: PromptMaker, seed: int,
                                  api_key: str | None) -> tuple[list[RequestRecord], float]:
    """`plan.streams` closed-loop streams run from t=0 while bursts arrive every `burst_every` s; the streams stop
    (in-flight ones cut off) once `duration` has passed and every burst request has finished."""
    bursts = burst_specs(plan, specs, prompts, seed)
    async with make_session(api_key) as session:
        clock = Clock.start()
        bursts_done = asyncio.Event()

        def stop() -> bool:
            return bursts_done.is_set() and clock.now() >= plan.duration

        streams = [asyncio.create_task(_stream_loop(session, target, opts, clock, stop, i, specs[plan.stream_quadrant],
                                                    prompts, seed)) for i in range(plan.streams)]
        burst_records = await asyncio.gather(*(_fire(session, target, opts, spec, clock) for spec in bursts))
        bursts_done.set()
        stream_records = [r for records in await asyncio.gather(*streams) for r in records]
        return stream_records + list(burst_records), clock.now()


async def _stream_loop(session: aiohttp.ClientSession, target: Target, opts: ClientOptions, clock: Clock,
                       stop: Callable[[], bool], stream: int, spec: QuadrantSpec, prompts: PromptMaker,
                       seed: int) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    while not stop():
        request = _request(len(records), spec.name, clock.now(), spec, prompts, (seed, 2, stream, len(records)),
                           None, stream)
        records.append(await run_request(session, target, opts, request, clock, stop))
        if records[-1].error:
            await asyncio.sleep(0.5)  # a failing server: do not spin
    return records


@dataclass(frozen=True)
class BurstItl:
    bursts: int
    window_mean_s: float  # from a burst's first send to its last first token
    itl_in_bursts_n: int
    itl_in_bursts_p50: float
    itl_in_bursts_p99: float
    itl_in_bursts_max: float
    itl_outside_n: int
    itl_outside_p50: float
    itl_outside_p99: float
    burst_ttft_p50: float
    burst_ttft_p99: float


def burst_windows(records: Iterable[RequestRecord]) -> list[tuple[float, float]]:
    """Per burst: (first send, last first token) — the span in which its prompts are being prefilled."""
    spans: dict[int, tuple[float, float]] = {}
    for r in records:
        if r.burst is None:
            continue
        prefilled = r.token_times[0] if r.token_times else r.end
        lo, hi = spans.get(r.burst, (r.sent, prefilled))
        spans[r.burst] = (min(lo, r.sent), max(hi, prefilled))
    return [spans[k] for k in sorted(spans)]


def split_itls(records: Iterable[RequestRecord], windows: Sequence[tuple[float, float]]) -> tuple[list[float],
                                                                                                   list[float]]:
    """ITL gaps of the non-burst requests: (those overlapping a burst window, the others)."""
    inside: list[float] = []
    outside: list[float] = []
    for r in records:
        if r.burst is not None:
            continue
        for a, b in zip(r.token_times, r.token_times[1:]):
            overlaps = any(a < hi and b > lo for lo, hi in windows)
            (inside if overlaps else outside).append(b - a)
    return inside, outside


def burst_itl(records: Sequence[RequestRecord]) -> BurstItl | None:
    windows = burst_windows(records)
    if not windows:
        return None
    inside, outside = split_itls(records, windows)
    ttfts = [r.ttft for r in records if r.burst is not None and r.error is None and r.ttft is not None]
    return BurstItl(len(windows), float(np.mean([hi - lo for lo, hi in windows])), len(inside),
                    percentile(inside, 50), percentile(inside, 99), max(inside, default=math.nan), len(outside),
                    percentile(outside, 50), percentile(outside, 99), percentile(ttfts, 50), percentile(ttfts, 99))


# ------------------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class Slo:
    ttft: float = 2.0
    tpot: float = 0.2
    target: float = 0.9


def percentile(values: Sequence[float], q: float) -> float:
    """Linearly interpolated percentile (q in 0..100); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Both objectives met; a request with one output token has no TPOT and is judged on TTFT alone."""
    if record.error is not None or record.ttft is None:
        return False
    return record.ttft <= slo.ttft and (record.tpot is None or record.tpot <= slo.tpot)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else math.nan


@dataclass(frozen=True)
class Stats:
    count: int
    errors: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    e2e_p99: float
    slo_attainment: float
    prompt_tokens_mean: float  # as the server counted them (NaN when it sends no usage)
    prompt_tokens_target_mean: float
    output_tokens_mean: float


def stats(records: Sequence[RequestRecord], slo: Slo) -> Stats:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    gaps = [g for r in ok for g in itls(r)]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    counted = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return Stats(len(records), len(records) - len(ok), *(percentile(ttft, q) for q in (50, 90, 99)),
                 *(percentile(tpot, q) for q in (50, 90, 99)), percentile(gaps, 50), percentile(gaps, 99),
                 percentile(e2e, 50), percentile(e2e, 99), attainment(records, slo), _mean(counted),
                 _mean([r.prompt_tokens_target for r in records]), _mean([r.output_tokens for r in ok]))


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def summarise(records: Sequence[RequestRecord], slo: Slo) -> dict[str, Stats]:
    """Per quadrant present (in quadrant order) and "all"; steady streams cut off by the run's end are left out."""
    kept = [r for r in records if not r.cut_off]
    out = {q: stats([r for r in kept if r.quadrant == q], slo) for q in QUADRANTS if any(r.quadrant == q for r in kept)}
    out["all"] = stats(kept, slo)
    return out


@dataclass(frozen=True)
class Goodput:
    rates: tuple[float, ...]
    attainment: tuple[float, ...]
    target: float
    max_passing_rate: float  # highest tested rate below the first failing one (0 when the lowest rate fails)
    interpolated_rate: float  # linear crossing of the target between that rate and the first failing one
    all_pass: bool  # every tested rate passes: goodput is at least the highest rate tested
    monotonic: bool  # False when a rate above the first failing one passes again (noise or overload)


def goodput(points: Iterable[tuple[float, float]], target: float = 0.9) -> Goodput:
    """DistServe's goodput from (rate, attainment) points of a sweep."""
    pts = sorted(points)
    if not pts:
        raise ValueError("goodput needs at least one (rate, attainment) point")
    rates, atts = tuple(p[0] for p in pts), tuple(p[1] for p in pts)
    fail = next((i for i, a in enumerate(atts) if not a >= target), None)
    if fail is None:
        return Goodput(rates, atts, target, rates[-1], rates[-1], True, True)
    monotonic = not any(a >= target for a in atts[fail:])
    if fail == 0:
        return Goodput(rates, atts, target, 0.0, 0.0, False, monotonic)
    (r0, a0), (r1, a1) = pts[fail - 1], pts[fail]
    crossing = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)
    return Goodput(rates, atts, target, r0, crossing, False, monotonic)


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class RunResult:
    server: str
    url: str
    label: str  # "rate 2" or "bursts"
    rate: float | None
    wall_s: float
    records: list[RequestRecord]
    summary: dict[str, Stats]
    bursts: BurstItl | None


def make_result(target: Target, label: str, rate: float | None, wall: float, records: list[RequestRecord],
                slo: Slo) -> RunResult:
    return RunResult(target.name, target.url, label, rate, wall, records, summarise(records, slo), burst_itl(records))


def parse_targets(url: str, compare: str | None) -> list[Target]:
    if not compare:
        return [Target("server", _check_url(url))]
    targets: list[Target] = []
    for item in (part.strip() for part in compare.split(",") if part.strip()):
        name, sep, address = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--compare wants NAME=URL items, got {item!r}")
        if any(t.name == name.strip() for t in targets):
            raise ValueError(f"--compare: name {name.strip()!r} given twice")
        targets.append(Target(name.strip(), _check_url(address.strip())))
    if not targets:
        raise ValueError("--compare lists no servers")
    return targets


def duplicate_url_warnings(targets: Sequence[Target]) -> list[str]:
    """The same server twice gets the same prompts twice: the second run hits the prefix cache of the first."""
    seen: dict[str, str] = {}
    warnings = []
    for t in targets:
        if t.url in seen:
            warnings.append(f"warning: {t.name} and {seen[t.url]} are the same server ({t.url}); {t.name} will "
                            f"find the same prompts in its prefix cache")
        seen.setdefault(t.url, t.name)
    return warnings


def _check_url(url: str) -> str:
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url.rstrip("/")


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--rates wants numbers separated by commas, got {text!r}") from None
    if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"--rates wants positive numbers, got {text!r}")
    return rates


def resolve_context(flag: int, infos: Sequence[ServerInfo]) -> tuple[int, str]:
    """The smallest context any server reports (so that every server gets the same requests), else the flag."""
    reported = [i.max_model_len for i in infos if i.max_model_len]
    if reported:
        return min(reported), "max_model_len reported by the server" + ("s (smallest)" if len(reported) > 1 else "")
    return flag, "--context (the server reported no max_model_len)"


# ------------------------------------------------------------------------------------------------ report text
def _ms(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 1e3:.0f}"


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v * 100:.0f}%"


def format_summary_table(results: Sequence[RunResult]) -> str:
    """One block per quadrant, one row per run (server / rate), times in ms."""
    header = (f"  {'run':<24}{'n':>5}{'err':>5}  {'TTFT p50/p90/p99':>20}  {'TPOT p50/p90/p99':>18}  "
              f"{'ITL p50/p99':>12}  {'e2e p50/p99':>13}  {'SLO':>5}")
    lines: list[str] = []
    keys = [q for q in (*QUADRANTS, "all") if any(q in r.summary for r in results)]
    for key in keys:
        lines += [f"{key.upper()} (ms)", header]
        for r in results:
            s = r.summary.get(key)
            if s is not None:
                lines.append(_summary_row(f"{r.server} {r.label}", s))
    return "\n".join(lines)


def _summary_row(name: str, s: Stats) -> str:
    ttft = "/".join(_ms(v) for v in (s.ttft_p50, s.ttft_p90, s.ttft_p99))
    tpot = "/".join(_ms(v) for v in (s.tpot_p50, s.tpot_p90, s.tpot_p99))
    e2e = "/".join(_ms(v) for v in (s.e2e_p50, s.e2e_p99))
    return (f"  {name:<24}{s.count:>5}{s.errors:>5}  {ttft:>20}  {tpot:>18}  "
            f"{_ms(s.itl_p50) + '/' + _ms(s.itl_p99):>12}  {e2e:>13}  {_pct(s.slo_attainment):>5}")


def format_bursts(results: Sequence[RunResult]) -> str:
    rows = [r for r in results if r.bursts]
    if not rows:
        return ""
    lines = ["ITL of the other streams while burst prompts are prefilled (ms)",
             f"  {'run':<24}{'bursts':>7}{'window':>8}  {'in: n p50 p99 max':>22}  {'outside: n p50 p99':>20}  "
             f"{'burst TTFT p50/p99':>18}"]
    for r in rows:
        b = r.bursts
        inside = f"{b.itl_in_bursts_n} {_ms(b.itl_in_bursts_p50)} {_ms(b.itl_in_bursts_p99)} {_ms(b.itl_in_bursts_max)}"
        outside = f"{b.itl_outside_n} {_ms(b.itl_outside_p50)} {_ms(b.itl_outside_p99)}"
        lines.append(f"  {r.server + ' ' + r.label:<24}{b.bursts:>7}{_ms(b.window_mean_s):>8}  {inside:>22}  "
                     f"{outside:>20}  {_ms(b.burst_ttft_p50) + '/' + _ms(b.burst_ttft_p99):>18}")
    return "\n".join(lines)


def format_goodput(goodputs: Mapping[str, Goodput]) -> str:
    lines = []
    for server, g in goodputs.items():
        per_rate = ", ".join(f"{r:g}/s: {_pct(a)}" for r, a in zip(g.rates, g.attainment))
        if g.all_pass:
            verdict = f">= {g.max_passing_rate:g} req/s (every tested rate passes; test higher rates)"
        elif g.max_passing_rate == 0:
            verdict = f"< {g.rates[0]:g} req/s (the lowest tested rate already fails)"
        else:
            verdict = f"{g.max_passing_rate:g} req/s tested, {g.interpolated_rate:.2f} req/s interpolated"
        note = "" if g.monotonic else "  [not monotonic: a higher rate passes again]"
        lines.append(f"  {server:<12} goodput {verdict}; attainment {per_rate}{note}")
    return "\n".join(lines)


def format_headers(results: Sequence[RunResult]) -> str:
    """Counts of X-Quadrant / X-Placement values and of server quadrant vs workload quadrant agreement."""
    lines = []
    for r in results:
        classified = [x for x in r.records if x.x_quadrant]
        placed = [x.x_placement for x in r.records if x.x_placement]
        if not classified and not placed:
            continue
        agree = sum(x.x_quadrant.strip().lower() == x.quadrant for x in classified)
        lines.append(f"  {r.server} {r.label}: X-Quadrant agrees with the workload's quadrant on "
                     f"{agree}/{len(classified)}; placements {_counts(placement_path(p) for p in placed)}")
    return ("Server headers\n" + "\n".join(lines)) if lines else ""


def placement_path(header: str) -> str:
    """The decision at the head of an X-Placement header ("disaggregated; decode=d0; ..." -> "disaggregated")."""
    return header.split(";")[0].strip() or "?"


def _counts(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def format_errors(results: Sequence[RunResult], limit: int = 5) -> str:
    errors = [f"  {r.server} {r.label} #{x.index} {x.quadrant}: {x.error}" for r in results for x in r.records
              if x.error]
    if not errors:
        return ""
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return "Errors\n" + "\n".join(errors[:limit]) + more


# ------------------------------------------------------------------------------------------------ JSON and plots
def jsonable(value: Any) -> Any:
    """NaN/inf -> None (valid JSON), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def result_json(result: RunResult) -> dict[str, Any]:
    records = [{**asdict(r), "itls": itls(r)} for r in result.records]
    return {"server": result.server, "url": result.url, "label": result.label, "rate": result.rate,
            "wall_s": result.wall_s, "summary": {k: asdict(v) for k, v in result.summary.items()},
            "bursts": asdict(result.bursts) if result.bursts else None, "records": records}


def write_json(path: Path, meta: Mapping[str, Any], results: Sequence[RunResult],
               goodputs: Mapping[str, Goodput]) -> Path:
    doc = {**meta, "goodput": {k: asdict(v) for k, v in goodputs.items()}, "runs": [result_json(r) for r in results]}
    path.write_text(json.dumps(jsonable(doc), indent=1))
    return path


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Step points of the empirical CDF, starting at (smallest value, 0) so that one sample still draws a step."""
    xs = np.sort(np.asarray(values, dtype=float))
    return np.concatenate([xs[:1], xs]), np.arange(len(xs) + 1) / len(xs)


def plot_cdfs(results: Sequence[RunResult], path: Path) -> Path:
    """TTFT (top) and ITL (bottom) CDFs, one panel per quadrant, one line per server."""
    plt = _pyplot()
    keys = [q for q in (*QUADRANTS, "all") if any(q in r.summary for r in results)]
    fig, axes = plt.subplots(2, len(keys), figsize=(3.6 * len(keys), 6.4), squeeze=False)
    for col, key in enumerate(keys):
        for r in results:
            ok = [x for x in r.records if x.error is None and not x.cut_off and key in ("all", x.quadrant)]
            _cdf_line(axes[0][col], [x.ttft for x in ok if x.ttft is not None], r.server)
            _cdf_line(axes[1][col], [g for x in ok for g in itls(x)], r.server)
        axes[0][col].set_title(f"{key.upper()} TTFT")
        axes[1][col].set_title(f"{key.upper()} ITL")
    for ax in axes.flat:
        _style_cdf_axis(ax)
    fig.suptitle(f"latency CDFs, {results[0].label}")
    return _save(fig, plt, path)


def _cdf_line(ax: Any, values: Sequence[float], label: str) -> None:
    if values:
        xs, ys = ecdf(np.maximum(np.asarray(values) * 1e3, 0.1))  # ms; log axis: coalesced chunks' 0 gaps -> 0.1
        ax.step(xs, ys, where="post", label=label)


def _style_cdf_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("ms (log scale)")
    ax.set_ylabel("fraction of requests / gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def plot_goodput(goodputs: Mapping[str, Goodput], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for server, g in goodputs.items():
        line, = ax.plot(g.rates, g.attainment, marker="o", label=f"{server} (goodput {_goodput_text(g)})")
        if not g.all_pass and g.interpolated_rate > 0:
            ax.axvline(g.interpolated_rate, color=line.get_color(), linestyle=":", alpha=0.7)
    target = next(iter(goodputs.values())).target
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("SLO attainment vs rate")
    return _save(fig, plt, path)


def _goodput_text(g: Goodput) -> str:
    return f">={g.max_passing_rate:g}" if g.all_pass else f"{g.interpolated_rate:.2f}"


def plot_burst_timeline(results: Sequence[RunResult], path: Path) -> Path:
    """Per server: every ITL gap of the non-burst streams over time, burst prefill windows shaded."""
    plt = _pyplot()
    rows = [r for r in results if r.bursts]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.8 * len(rows)), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], rows):
        for lo, hi in burst_windows(r.records):
            ax.axvspan(lo, hi, color="tab:red", alpha=0.15)
        points = [(b, b - a) for x in r.records if x.burst is None for a, b in zip(x.token_times, x.token_times[1:])]
        if points:
            ax.scatter([p[0] for p in points], [p[1] * 1e3 for p in points], s=3)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{r.server} {r.label}: stream ITL, burst prefill windows shaded "
                     f"(p99 in {_ms(r.bursts.itl_in_bursts_p99)} ms, outside {_ms(r.bursts.itl_outside_p99)} ms)",
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("seconds since the run started")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, name: str, results: Sequence[RunResult], goodputs: Mapping[str, Goodput]) -> list[Path]:
    paths = []
    for label in dict.fromkeys(r.label for r in results):
        tag = label.replace(" ", "")
        paths.append(plot_cdfs([r for r in results if r.label == label], out_dir / f"{name}_cdf_{tag}.png"))
    if goodputs and len(next(iter(goodputs.values())).rates) > 1:
        paths.append(plot_goodput(goodputs, out_dir / f"{name}_goodput.png"))
    if any(r.bursts for r in results):
        paths.append(plot_burst_timeline(results, out_dir / f"{name}_itl_bursts.png"))
    return paths


# ------------------------------------------------------------------------------------------------ command line
@dataclass(frozen=True)
class BenchConfig:
    targets: tuple[Target, ...]
    model: str | None
    api_key: str | None
    context: int
    max_long_in: int
    max_long_out: int
    tokenizer: str | None
    tokens_per_word: float
    mix: Mix
    rates: tuple[float, ...]
    sweep: bool
    duration: float | None
    num_requests: int | None
    burst_every: float
    burst_size: int
    seed: int
    ignore_eos: bool
    slo: Slo
    timeout: float
    cooldown: float
    out_dir: Path
    name: str
    plots: bool
    dry_run: bool
    itl_under_bursts: bool
    streams: int
    stream_quadrant: str
    burst_quadrant: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("servers")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server to test")
    g.add_argument("--compare", default=None, help="NAME=URL,NAME=URL: the same workload against each, in turn")
    g.add_argument("--model", default=None, help="model field to send (default: the first of /v1/models)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--timeout", type=float, default=120.0, help="per-request limit, seconds")
    g = p.add_argument_group("lengths")
    g.add_argument("--context", type=int, default=8192, help="used when /v1/models reports no max_model_len")
    g.add_argument("--max-long-in", type=int, default=2048, help="cap on long prompts (tokens)")
    g.add_argument("--max-long-out", type=int, default=512, help="cap on long outputs (tokens)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) for exact prompt lengths")
    g.add_argument("--tokens-per-word", type=float, default=TOKENS_PER_WORD,
                   help="length estimate without --tokenizer (the report shows what the server counted)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    g = p.add_argument_group("arrivals")
    g.add_argument("--mix", default="chat", help=f"q=w,... or a named mix: {', '.join(NAMED_MIXES)}")
    g.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    g.add_argument("--rates", default=None, help="sweep these rates (e.g. 0.5,1,2,4) and report goodput")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    g.add_argument("--num-requests", type=int, default=None, help="requests per run (instead of --duration)")
    g.add_argument("--burst-every", type=float, default=10.0, help="seconds between bursts")
    g.add_argument("--burst-size", type=int, default=2, help="requests per burst")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cooldown", type=float, default=2.0, help="pause between runs, seconds")
    g = p.add_argument_group("SLOs")
    g.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    g.add_argument("--slo-tpot", type=float, default=0.2, help="seconds")
    g.add_argument("--slo-target", type=float, default=0.9, help="attainment that counts as passing")
    g = p.add_argument_group("ITL under bursts")
    g.add_argument("--itl-under-bursts", action="store_true",
                   help="steady closed-loop streams plus bursts: ITL of the streams during the bursts' prefill")
    g.add_argument("--streams", type=int, default=8, help="concurrent steady streams")
    g.add_argument("--stream-quadrant", choices=("siso", "silo"), default="silo")
    g.add_argument("--burst-quadrant", choices=QUADRANTS, default="liso")
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default="bench/results")
    g.add_argument("--name", default="workloads", help="prefix of the output files")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--dry-run", action="store_true", help="print the workload and send nothing")
    return p


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return _config(a)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _config(a: argparse.Namespace) -> BenchConfig:
    if a.timeout <= 0 or a.streams < 1 or a.context < 1 or a.seed < 0 or not a.tokens_per_word > 0:
        raise ValueError("--timeout, --streams, --context and --tokens-per-word must be positive, --seed >= 0")
    if not 0 < a.slo_target <= 1 or a.slo_ttft <= 0 or a.slo_tpot <= 0:
        raise ValueError("SLOs must be positive and --slo-target in (0, 1]")
    if a.itl_under_bursts and (a.num_requests or a.rates):
        raise ValueError("--itl-under-bursts runs for --duration; it takes no --num-requests or --rates")
    rates = parse_rates(a.rates) if a.rates else [a.rate]
    duration = None if a.num_requests else a.duration
    ArrivalPlan(rates[0], duration, a.num_requests, a.burst_every, a.burst_size)  # validates
    return BenchConfig(
        targets=tuple(parse_targets(a.url, a.compare)), model=a.model, api_key=a.api_key, context=a.context,
        max_long_in=a.max_long_in, max_long_out=a.max_long_out, tokenizer=a.tokenizer,
        tokens_per_word=a.tokens_per_word, mix=parse_mix(a.mix), rates=tuple(rates), sweep=a.rates is not None,
        duration=duration, num_requests=a.num_requests, burst_every=a.burst_every, burst_size=a.burst_size,
        seed=a.seed, ignore_eos=a.ignore_eos, slo=Slo(a.slo_ttft, a.slo_tpot, a.slo_target), timeout=a.timeout,
        cooldown=a.cooldown, out_dir=Path(a.out_dir), name=a.name, plots=not a.no_plots, dry_run=a.dry_run,
        itl_under_bursts=a.itl_under_bursts, streams=a.streams, stream_quadrant=a.stream_quadrant,
        burst_quadrant=a.burst_quadrant)


def describe_workload(workload: Sequence[RequestSpec]) -> str:
    parts = []
    for q in QUADRANTS:
        mine = [w for w in workload if w.quadrant == q]
        if mine:
            ins, outs = [w.prompt_tokens for w in mine], [w.max_tokens for w in mine]
            parts.append(f"{q} x{len(mine)} (in {min(ins)}-{max(ins)}, out {min(outs)}-{max(outs)})")
    span = workload[-1].arrival if workload else 0.0
    return f"{len(workload)} requests over {span:.1f} s: " + ", ".join(parts)


def describe_specs(specs: Mapping[str, QuadrantSpec]) -> str:
    return "; ".join(f"{q.upper()} in U[{s.prompt.lo},{s.prompt.hi}] out U[{s.output.lo},{s.output.hi}]"
                     for q, s in specs.items())


async def run_bench(cfg: BenchConfig, origin: Mapping[str, Any] | None = None) -> int:
    """`origin`: the provenance written at the head of the JSON (default: this bench and its command line)."""
    async with make_session(cfg.api_key) as session:
        infos = [await discover(session, t.url) for t in cfg.targets]
    for warning in duplicate_url_warnings(cfg.targets):
        print(warning, file=sys.stderr)
    for t, info in zip(cfg.targets, infos):
        print(f"{t.name}: {t.url}  model={info.model or cfg.model or '(none)'}  "
              f"max_model_len={info.max_model_len or '?'}" + (f"  ({info.error})" if info.error else ""))
    unreachable = [t.url for t, info in zip(cfg.targets, infos) if not info.reachable]
    if unreachable and not cfg.dry_run:
        raise ValueError(f"cannot reach {', '.join(unreachable)} (is the server running?)")
    context, source = resolve_context(cfg.context, infos)
    specs = quadrant_specs(context, cfg.max_long_in, cfg.max_long_out)
    prompts = PromptMaker(cfg.tokenizer, cfg.tokens_per_word)
    print(f"context {context} ({source}); {describe_specs(specs)}")
    print(f"prompt lengths: {prompts.method}")
    opts = [ClientOptions(cfg.model or info.model, cfg.ignore_eos, cfg.timeout) for info in infos]
    if cfg.itl_under_bursts:
        results = await _bursts_runs(cfg, opts, specs, prompts)
    else:
        results = await _rate_runs(cfg, opts, specs, prompts)
    if results is None:
        return 0
    return report(cfg, results, {**(origin or provenance("workloads")), "context": context,
                                 "context_source": source, "token_counting": prompts.method,
                                 "quadrants": {k: asdict(v) for k, v in specs.items()}})


async def _rate_runs(cfg: BenchConfig, opts: Sequence[ClientOptions], specs: Mapping[str, QuadrantSpec],
                     prompts: PromptMaker) -> list[RunResult] | None:
    workloads = {rate: build_workload(cfg.mix, ArrivalPlan(rate, cfg.duration, cfg.num_requests, cfg.burst_every,
                                                           cfg.burst_size), specs, prompts, cfg.seed)
                 for rate in cfg.rates}
    for rate, workload in workloads.items():
        print(f"mix {cfg.mix.label} at {rate:g} req/s: {describe_workload(workload)}")
    if cfg.dry_run:
        return None
    results = []
    for target, opt in zip(cfg.targets, opts):
        for rate, workload in workloads.items():
            if results:
                await asyncio.sleep(cfg.cooldown)
            print(f"running {target.name} at {rate:g} req/s ...", flush=True)
            records, wall = await run_schedule(target, opt, workload, cfg.api_key)
            results.append(make_result(target, f"rate {rate:g}", rate, wall, records, cfg.slo))
    return results


async def _bursts_runs(cfg: BenchConfig, opts: Sequence[ClientOptions], specs: Mapping[str, QuadrantSpec],
                       prompts: PromptMaker) -> list[RunResult] | None:
    plan = StreamsPlan(cfg.streams, cfg.stream_quadrant, cfg.burst_quadrant, cfg.duration or 0.0, cfg.burst_every,
                       cfg.burst_size)
    bursts = burst_specs(plan, specs, prompts, cfg.seed)
    print(f"{plan.streams} steady {plan.stream_quadrant} streams for {plan.duration:g} s; "
          f"{describe_workload(bursts)} in bursts of {plan.burst_size} every {plan.burst_every:g} s")
    if not bursts:
        raise ValueError("no bursts fit: make --duration longer than --burst-every")
    if cfg.dry_run:
        return None
    results = []
    for target, opt in zip(cfg.targets, opts):
        if results:
            await asyncio.sleep(cfg.cooldown)
        print(f"running {target.name} ...", flush=True)
        records, wall = await run_streams_with_bursts(target, opt, plan, specs, prompts, cfg.seed, cfg.api_key)
        results.append(make_result(target, "bursts", None, wall, records, cfg.slo))
    return results


def goodputs_of(results: Sequence[RunResult], target: float) -> dict[str, Goodput]:
    points: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r.rate is not None:
            points.setdefault(r.server, []).append((r.rate, r.summary["all"].slo_attainment))
    return {server: goodput(pts, target) for server, pts in points.items()}


def report(cfg: BenchConfig, results: Sequence[RunResult], meta: Mapping[str, Any]) -> int:
    goodputs = goodputs_of(results, cfg.slo.target)
    print(f"\nSLO: TTFT <= {cfg.slo.ttft:g} s and TPOT <= {cfg.slo.tpot:g} s")
    print(format_summary_table(results))
    for block in (format_bursts(results), format_headers(results), format_errors(results)):
        if block:
            print("\n" + block)
    if cfg.sweep:
        print(f"\nGoodput (highest rate with >= {cfg.slo.target:.0%} of requests meeting both SLOs)")
        print(format_goodput(goodputs))
    print("\n" + token_note([x for r in results for x in r.records], None if cfg.tokenizer else cfg.tokens_per_word))
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    paths = [write_json(cfg.out_dir / f"{cfg.name}.json", {**meta, "config": _plain(config)}, results, goodputs)]
    if cfg.plots:
        paths += write_plots(cfg.out_dir, cfg.name, results, goodputs)
    print("wrote " + "\n      ".join(str(p) for p in paths))
    return 1 if any(r.summary["all"].errors == r.summary["all"].count for r in results) else 0


def token_note(records: Sequence[RequestRecord], tokens_per_word: float | None) -> str:
    """How close the prompt lengths came to their targets, from the requests whose usage the server reported;
    `tokens_per_word` is the estimate in use (None with a tokenizer)."""
    pairs = [(r.prompt_tokens_target, r.prompt_tokens) for r in records if r.prompt_tokens is not None]
    if not pairs:
        return "prompt tokens: the server reported no usage, so the lengths are unchecked"
    ratio = sum(p[1] for p in pairs) / sum(p[0] for p in pairs)
    note = f"prompt tokens: the server counted {ratio:.2f}x the target (mean over {len(pairs)} requests)"
    if tokens_per_word is None:
        return note + "; the difference is the special tokens the server adds"
    return note + (f"; the lengths are a per-word estimate: --tokens-per-word {tokens_per_word * ratio:.2f} "
                   f"or --tokenizer would match this server")


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None, origin: Mapping[str, Any] | None = None) -> int:
    """`origin`: the provenance of a bench that drives this one (bench/placement.py), else this command line."""
    cfg = parse_args(argv)
    try:
        return asyncio.run(run_bench(cfg, origin or provenance("workloads", argv)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
