"""Prometheus metrics with vLLM's names under the `phase_serve:` prefix, in a registry owned by one app.

Every series of the scrape carries `model_name` (the served model name) and none is a `_created` series: the
app's metrics live in an inner registry that `ModelLabelled` relabels and filters at scrape time, so neither
needs prometheus_client's process-wide switches. The standard process, platform and GC collectors are in it
too.
"""
from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from actors.supervisor import ActorState
from engine.core.stats import EngineStats
from engine.speculative.adaptive import SpecCounts
from server.quadrant import Quadrant

PREFIX = "phase_serve:"
LATENCY_LABELS = ("quadrant", "path")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)
SUCCESS_REASONS = ("stop", "length")
MODEL_LABEL = "model_name"
UNMATCHED_ROUTE = "unmatched"  # the handler label of a request no route matched (404, 405)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length, which is the last bucket (as vLLM builds them)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= max_model_len:
                return (*buckets, max_model_len)
            buckets.append(step * scale)
        scale *= 10


@dataclass(frozen=True)
class RequestRecord:
    """What one finished (or abandoned) request contributes to the metrics."""

    quadrant: str
    path: str
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: tuple[str | None, ...]  # one per sample; None or "abort" when cut short
    ttft: float | None = None
    inter_token_latencies: tuple[float, ...] = ()
    tpot: float | None = None
    e2e: float | None = None
    spec: SpecCounts | None = None  # speculative decoding, when the request speculated
    queue: float | None = None  # HTTP arrival to submission to the engine
    prefill: float | None = None  # submission to the first token's arrival from the engine
    decode: float | None = None  # first to last token's arrival from the engine
    placed: bool = True  # the engine answered at least once, so `path` is where the router placed it

    @property
    def succeeded(self) -> bool:
        return bool(self.finish_reasons) and all(r in SUCCESS_REASONS for r in self.finish_reasons)


class EngineStatsCollector:
    """Gauges and counters read from the engine at scrape time, so they are never stale."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield _gauge("num_requests_running", "Requests with sequences in the running batch.", s.running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield _gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage)
        yield _gauge("kv_cache_compressed_blocks", "KV pages held compressed in the FP4 region (--kv-compress).",
                     s.kv_blocks_compressed)
        yield _counter("kv_cache_compressions", "KV pages compressed to FP4 to avoid preemption (--kv-compress).",
                       s.kv_compressions)
        yield _counter("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", s.prefix_queries)
        yield _counter("prefix_cache_hits", "Prompt blocks found in the prefix cache.", s.prefix_hits)
        yield _counter("num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                       s.num_preemptions)
        yield from tier_metrics(s)


KV_TIERS = ("host", "disk")
# name -> (kind, help, EngineStats field after "kv_<tier>_"); vLLM's external prefix cache names where it has them
TIER_FAMILIES = {
    "external_prefix_cache_queries": ("counter", "Prompt blocks looked up in a KV tier below the pool (past the "
                                      "prefix cache and the tiers above it).", "queries"),
    "external_prefix_cache_hits": ("counter", "Prompt blocks loaded from a KV tier instead of computed.", "hits"),
    "kv_tier_bytes_loaded": ("counter", "KV bytes loaded from a tier into the pool.", "bytes_loaded"),
    "kv_tier_bytes_stored": ("counter", "KV bytes of evicted blocks written back to a tier.", "bytes_stored"),
    "kv_tier_usage_bytes": ("gauge", "Bytes a KV tier holds (every engine sharing it).", "bytes_used"),
    "kv_tier_capacity_bytes": ("gauge", "Bytes a KV tier may hold.", "bytes_total"),
}


def tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """The KV tiers' families, labelled by tier, for the tiers that exist (a capacity); nothing without tiers."""
    tiers = [t for t in KV_TIERS if getattr(s, f"kv_{t}_bytes_total")]
    if not tiers:
        return
    for name, (kind, doc, field) in TIER_FAMILIES.items():
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(PREFIX + name, doc,
                                                                                  labels=("tier",))
        for tier in tiers:
            family.add_metric((tier,), getattr(s, f"kv_{tier}_{field}"))
        yield family
    yield _counter("kv_tier_dropped_stores", "Evicted blocks not written back: the tiers' write queue was full, "
                   "or a tier's file system full or failing.",
                   s.kv_tier_dropped_stores)
    yield _counter("kv_tier_bad_entries", "KV tier entries found truncated, corrupt or foreign, read as misses.",
                   s.kv_tier_bad_entries)


class RouterCollector:
    """The router's cumulative counters (KV hand-offs, stream migrations), read at scrape time; none in-process."""

    DOCS = {"kv_transfers": "KV hand-offs from a prefill actor to a decode actor.",
            "kv_bytes_transferred": "KV bytes handed from prefill actors to decode actors.",
            "migrations": "Streams moved to another decode actor (its own died or drained) and resumed there.",
            "migrated_tokens": "Tokens those streams had already sent, recomputed on the new actor (never re-sent).",
            "failed_migrations": "Streams that could not be moved (too many moves, or no decode actor in time).",
            "role_changes": "Actors that changed between prefill and decode (elastic switches, degraded and "
                            "restored decode roles).",
            "failed_role_changes": "Role changes that failed (the actor was restarted in its old role)."}

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        counters = self._counters()
        for name, doc in self.DOCS.items():
            if name in counters:
                yield _counter(name, doc, counters[name])


class LayoutCollector:
    """The actors' layout, read at scrape time: seconds spent in each layout ("1P+1D": one prefill actor and one
    decode actor; "none": no decode actor served), the switches the elastic planner made, and the current layout
    (value 1); none in-process."""

    def __init__(self, layout: Callable[[], dict]) -> None:
        self._layout = layout

    def collect(self) -> Iterator[Metric]:
        layout = self._layout()
        if not layout:
            return
        seconds = CounterMetricFamily(PREFIX + "layout_seconds", "Seconds the actors spent in each layout.",
                                      labels=("layout",))
        for name, value in sorted(layout.get("seconds_in_layout", {}).items()):
            seconds.add_metric((name,), value)
        yield seconds
        yield _counter("layout_switches", "Switches of the elastic planner (one actor's role change each).",
                       layout.get("switches", 0))
        current = GaugeMetricFamily(PREFIX + "layout", "The current layout (1).", labels=("layout",))
        current.add_metric((str(layout.get("current", "none")),), 1)
        yield current


class ActorCollector:
    """Actors by role and state, and restarts per actor, read from the supervisor's view at scrape time.
    Every state of a role that has actors is present (0 when none is in it), so an alert on `ready == 0`
    sees the series go to zero rather than disappear."""

    def __init__(self, actors: Callable[[], list[dict]]) -> None:
        self._actors = actors

    def collect(self) -> Iterator[Metric]:
        actors = self._actors()
        states = GaugeMetricFamily(PREFIX + "actors", "Actor processes by role and state (starting, ready, dead: "
                                   "waiting for its restart, failed: crash-looping and given up).",
                                   labels=("role", "state"))
        tally = Tally((str(a["role"]), str(a["state"])) for a in actors)
        for role in sorted({str(a["role"]) for a in actors}):
            for state in ActorState:
                states.add_metric((role, state.value), tally[(role, state.value)])
        yield states
        restarts = CounterMetricFamily(PREFIX + "actor_restarts", "Times the supervisor restarted an actor "
                                       "after its process died.", labels=("actor", "role"))
        for a in actors:
            restarts.add_metric((a["id"], str(a["role"])), a["restarts"])
        yield restarts


class ModelLabelled:
    """Every family of `inner` with `model_name` added to each sample and the `_created` samples left out."""

    def __init__(self, inner: CollectorRegistry, model_name: str) -> None:
        self._inner = inner
        self._labels = {MODEL_LABEL: model_name}

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            created = family.name + "_created"
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples
                           if s.name != created]
            yield out


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    """Request-level histograms and counters plus the engine's live gauges, in this object's registry."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str = "", max_model_len: int = 8192,
                 actors: Callable[[], list[dict]] = list, counters: Callable[[], dict[str, int]] = dict,
                 layout: Callable[[], dict] = dict) -> None:
        self._inner = CollectorRegistry(auto_describe=True)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                   TOKEN_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                                    TOKEN_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "HTTP arrival to the request's submission to the engine (parsing, "
            "tokenisation, admission). The server does not see when the engine's scheduler first runs the "
            "request: a wait in the router for a decode actor, or in an actor's waiting queue, counts in "
            "request_prefill_time_seconds (num_requests_waiting shows that queue).", PHASE_BUCKETS)
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds", "Submission to the engine to the first token's arrival from it: "
            "the engine's queue, the prefill and, when disaggregated, the KV hand-off.", PHASE_BUCKETS)
        self.decode_time = self._histogram(
            "request_decode_time_seconds", "First to last token's arrival from the engine.", PHASE_BUCKETS)
        self.prompt_tokens_hist = self._histogram(
            "request_prompt_tokens", "Prompt tokens per request that finished normally.", token_buckets(max_model_len))
        self.generation_tokens_hist = self._histogram(
            "request_generation_tokens", "Generated tokens (all samples) per request that finished normally.",
            token_buckets(max_model_len))
        self.placements = self._counter("placement_decisions", "Requests by where the router placed them "
                                        "(colocated or disaggregated; in-process: colocated), counted as they end.",
                                        LATENCY_LABELS)
        self.http_requests = self._counter("http_requests", "HTTP responses by handler (the route's path), method "
                                           "and status; 499: the client went away first.",
                                           ("handler", "method", "status"))
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens, all samples.")
        self.success = self._counter("request_success", "Requests that finished normally.", ("finish_reason",))
        self.aborted = self._counter("request_aborted", "Requests cut short (client gone, shutdown, error).")
        self.spec_drafts = self._counter("spec_decode_num_drafts", "Speculative verification steps (one sequence, "
                                         "one step, at least one draft token), of finished requests.", ("quadrant",))
        self.spec_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified, "
                                               "of finished requests.", ("quadrant",))
        self.spec_accepted_tokens = self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted, of "
                                                  "finished requests.", ("quadrant",))
        for quadrant in Quadrant:  # present from the start at 0, so that rate() and the dashboard see them
            for counter in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
                counter.labels(quadrant=quadrant.value)
        self.spec_by_quadrant: dict[str, SpecCounts] = {}  # the same counts, for /status
        self._inner.register(EngineStatsCollector(stats))
        self._inner.register(ActorCollector(actors))
        self._inner.register(RouterCollector(counters))
        self._inner.register(LayoutCollector(layout))
        ProcessCollector(registry=self._inner)
        PlatformCollector(registry=self._inner)
        GCCollector(registry=self._inner)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ModelLabelled(self._inner, model_name))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, LATENCY_LABELS, buckets=buckets, registry=self._inner)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self._inner)

    def http_response(self, handler: str, method: str, status: int) -> None:
        self.http_requests.labels(handler=handler, method=method, status=str(status)).inc()

    def record(self, rec: RequestRecord) -> None:
        self.prompt_tokens.inc(rec.prompt_tokens)
        if rec.placed:
            self.placements.labels(quadrant=rec.quadrant, path=rec.path).inc()
        self.generation_tokens.inc(rec.completion_tokens)
        if rec.spec is not None:  # verified drafts cost work whether or not the request then succeeded
            self._record_spec(rec.quadrant, rec.spec)
        if not rec.succeeded:
            self.aborted.inc()
            return
        # One count per request (not per sample), labelled by the first sample's reason.
        self.success.labels(finish_reason=rec.finish_reasons[0]).inc()
        self._observe_latencies(rec)

    def _observe_latencies(self, rec: RequestRecord) -> None:
        labels = {"quadrant": rec.quadrant, "path": rec.path}
        observed = ((self.ttft, rec.ttft), (self.tpot, rec.tpot), (self.e2e, rec.e2e), (self.queue_time, rec.queue),
                    (self.prefill_time, rec.prefill), (self.decode_time, rec.decode),
                    (self.prompt_tokens_hist, rec.prompt_tokens), (self.generation_tokens_hist, rec.completion_tokens))
        for histogram, value in observed:
            if value is not None:
                histogram.labels(**labels).observe(value)
        itl = self.itl.labels(**labels)
        for gap in rec.inter_token_latencies:
            itl.observe(gap)

    def _record_spec(self, quadrant: str, spec: SpecCounts) -> None:
        self.spec_drafts.labels(quadrant=quadrant).inc(spec.num_verify_steps)
        self.spec_draft_tokens.labels(quadrant=quadrant).inc(spec.num_draft_proposed)
        self.spec_accepted_tokens.labels(quadrant=quadrant).inc(spec.num_draft_accepted)
        self.spec_by_quadrant[quadrant] = self.spec_by_quadrant.get(quadrant, SpecCounts()) + spec

    def speculation_by_quadrant(self) -> dict[str, dict[str, float]]:
        """Per quadrant: draft tokens proposed and accepted, verification steps, acceptance rate and mean
        accepted drafts per step."""
        return {quadrant: spec_summary(spec) for quadrant, spec in sorted(self.spec_by_quadrant.items())}

    def render(self) -> bytes:
        return generate_latest(self.registry)


def spec_summary(spec: SpecCounts) -> dict[str, float]:
    return {"proposed": spec.num_draft_proposed, "accepted": spec.num_draft_accepted,
            "steps": spec.num_verify_steps, "acceptance_rate": spec.acceptance_rate,
            "mean_accepted_length": spec.mean_accepted_length}


def kv_tiers_status(s: EngineStats) -> dict[str, Any]:
    """What /status shows of each KV tier that exists: its lookups and loads in blocks, bytes moved, occupancy;
    and the write-backs dropped and the bad entries met over all tiers. Empty without tiers."""
    status: dict[str, Any] = {}
    for tier in KV_TIERS:
        total = getattr(s, f"kv_{tier}_bytes_total")
        if not total:
            continue
        used, queries, hits = (getattr(s, f"kv_{tier}_{f}") for f in ("bytes_used", "queries", "hits"))
        status[tier] = {"queries": queries, "hits": hits, "misses": queries - hits,
                        "bytes_loaded": getattr(s, f"kv_{tier}_bytes_loaded"),
                        "bytes_stored": getattr(s, f"kv_{tier}_bytes_stored"),
                        "bytes_used": used, "bytes_total": total, "usage": used / total}
    if status:
        status["dropped_stores"] = s.kv_tier_dropped_stores
        status["bad_entries"] = s.kv_tier_bad_entries
    return status
