"""The Prometheus scrape of a real `cli.py serve` (prefill + decode actors, n-gram speculation, one request
slot): every metric the Grafana dashboard queries is in it, every series names the model and none is a
`_created` series, the request-phase histograms and the HTTP status counter count what was sent, and the
actor gauges follow a decode actor through kill -9 and restart. The unit tests drive ServerMetrics directly."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.stats import EngineStats
from server.metrics import RequestRecord, ServerMetrics, token_buckets
from tests.server_utils import ServerProcess, TINY_ENGINE_FLAGS, openai_client, start_server, wait_until

MODEL = "tiny-metrics"
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana-dashboard.json"
PROMQL_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                             "unless", "offset"})


# ---------------------------------------------------------------------------------------- PromQL names

def dashboard_queries(node: object) -> Iterator[str]:
    """Every `expr` of the dashboard's panels, and the metric of each `label_values(metric, label)` variable."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                yield from re.findall(r"label_values\(\s*([A-Za-z_:][\w:]*)", value)
            else:
                yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges
    and grouping clauses are removed, that are neither functions (followed by `(`) nor keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", expr):
        if match.group() in PROMQL_KEYWORDS or expr[match.end():].lstrip().startswith("("):
            continue
        names.add(match.group())
    return names


@pytest.mark.unit
def test_metric_names_of_promql():
    expr = ('histogram_quantile(0.99, sum by (le, quadrant) (rate(phase_serve:ttft_bucket{model_name=~"$m", '
            'path="a{b}"}[$__rate_interval]))) / on (quadrant) group_left sum(process_open_fds) > bool 0')
    assert metric_names(expr) == {"phase_serve:ttft_bucket", "process_open_fds"}
    assert list(dashboard_queries({"templating": {"list": [{"definition": "label_values(up, job)"}]}})) == ["up"]


# ---------------------------------------------------------------------------------------- scrapes

def scrape(server: ServerProcess) -> list:
    return list(text_string_to_metric_families(server.get("/metrics").body.decode()))


def sample_value(families: list, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for f in families for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("metrics") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--prefill-actors", "1",
                        "--decode-actors", "1", "--disagg", "always", "--speculative", "ngram",
                        "--speculate-quadrants", "all", "--max-queue", "1")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def served(client):
    """Requests that finished normally, sent once for the module: (count, generated tokens)."""
    count, tokens = 0, 0
    for prompt, max_tokens in (("one two three one two three one two", 24), ("Hello there", 5)):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
        count, tokens = count + 1, tokens + out.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    tokens += sum(chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None)
    return count + 1, tokens


def test_every_metric_the_dashboard_queries_is_in_a_real_scrape(server, served):
    queried = {name for expr in dashboard_queries(json.loads(DASHBOARD.read_text())) for name in metric_names(expr)}
    present = {s.name for f in scrape(server) for s in f.samples}
    assert queried and queried <= present, sorted(queried - present)
    for topic in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "kv_cache_usage_perc",
                  "num_requests_waiting", "request_queue_time_seconds_bucket", "placement_decisions_total",
                  "spec_decode_num_accepted_tokens_total", "actors", "actor_restarts_total"):
        assert "phase_serve:" + topic in queried, topic


def test_every_series_names_the_model_and_none_is_created(server, served):
    families = scrape(server)
    samples = [s for f in families for s in f.samples]
    assert samples and all(s.labels.get("model_name") == MODEL for s in samples)
    assert not [s.name for s in samples if s.name.endswith("_created")]
    names = {f.name for f in families}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= names


def test_request_histograms_count_each_finished_request(server, served):
    count, tokens = served
    families = scrape(server)
    assert sample_value(families, "phase_serve:request_success_total") == count
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "time_to_first_token_seconds"):
        assert sample_value(families, f"phase_serve:{name}_count") == count, name
    assert sample_value(families, "phase_serve:request_generation_tokens_sum") == tokens
    assert sample_value(families, "phase_serve:placement_decisions_total", path="disaggregated") == count
    assert sample_value(families, "phase_serve:spec_decode_num_drafts_total") > 0


def _open_stream(server: ServerProcess, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_http_responses_are_counted_by_handler_and_status(server, served):
    def count(status: str, handler: str = "/v1/completions") -> float:
        return sample_value(scrape(server), "phase_serve:http_requests_total", handler=handler, status=status)

    before = {status: count(status) for status in ("400", "429")}
    missing_before = count("404", "unmatched")
    bad = [server.post("/v1/completions", {"prompt": "x", "max_tokens": -1}),
           server.post("/v1/completions", {"prompt": "x", "temperature": "hot"})]
    assert [r.status for r in bad] == [400, 400]
    assert server.get("/v1/nowhere").status == 404
    conn, stream = _open_stream(server, {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "stream": True,
                                         "ignore_eos": True})
    try:
        assert stream.status == 200 and stream.readline().startswith(b"data:")
        assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status == 429
    finally:
        conn.close()
    assert wait_until(lambda: server.get("/status").json()["in_flight"] == 0, 30.0)
    assert count("400") - before["400"] == 2 and count("429") - before["429"] == 1
    assert count("404", "unmatched") - missing_before == 1
    assert count("200", "/metrics") > 0


def _actor_series(server: ServerProcess) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    families = scrape(server)
    states = {(s.labels["role"], s.labels["state"]): s.value for f in families for s in f.samples
              if s.name == "phase_serve:actors"}
    restarts = {s.labels["actor"]: s.value for f in families for s in f.samples
                if s.name == "phase_serve:actor_restarts_total"}
    return states, restarts


def test_actor_gauges_and_restarts_follow_a_killed_decode_actor(server, served):
    states, restarts = _actor_series(server)
    assert states[("decode", "ready")] == 1 and states[("prefill", "ready")] == 1
    assert states[("decode", "dead")] == 0 and set(restarts) == {"decode-0", "prefill-0"}
    decode = next(a for a in server.get("/status").json()["actors"] if a["role"] == "decode")
    os.kill(decode["pid"], signal.SIGKILL)
    assert wait_until(lambda: server.get("/health").status == 503, 10.0)
    assert wait_until(lambda: server.get("/health").status == 200, 60.0)
    states, after = _actor_series(server)
    assert after["decode-0"] == restarts["decode-0"] + 1 and after["prefill-0"] == restarts["prefill-0"]
    assert states[("decode", "ready")] == 1 and states[("decode", "dead")] == 0


# ---------------------------------------------------------------------------------------- ServerMetrics

ACTORS = [{"id": "decode-0", "role": "decode", "state": "ready", "restarts": 2},
          {"id": "decode-1", "role": "decode", "state": "dead", "restarts": 0},
          {"id": "prefill-0", "role": "prefill", "state": "starting", "restarts": 0}]


def _metrics() -> ServerMetrics:
    return ServerMetrics(EngineStats, "m", 1024, lambda: ACTORS)


@pytest.mark.unit
def test_token_buckets_end_at_the_context_length():
    assert token_buckets(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 1024)
    assert token_buckets(10) == (1, 2, 5, 10)


@pytest.mark.unit
def test_a_record_fills_the_phase_and_length_histograms():
    metrics = _metrics()
    metrics.record(RequestRecord("SILO", "colocated", 7, 30, ("length",), 0.2, (0.01,), 0.01, 0.5, None,
                                 queue=0.001, prefill=0.15, decode=0.3))
    metrics.record(RequestRecord("SISO", "colocated", 3, 0, (), placed=False))  # refused before any output
    families = list(text_string_to_metric_families(metrics.render().decode()))
    labels = {"quadrant": "SILO", "path": "colocated"}
    assert sample_value(families, "phase_serve:request_prefill_time_seconds_sum", **labels) == 0.15
    assert sample_value(families, "phase_serve:request_decode_time_seconds_count", **labels) == 1
    assert sample_value(families, "phase_serve:request_generation_tokens_sum", **labels) == 30
    assert sample_value(families, "phase_serve:request_prompt_tokens_bucket", le="5.0") == 0
    assert sample_value(families, "phase_serve:request_prompt_tokens_bucket", le="10.0") == 1
    assert sample_value(families, "phase_serve:placement_decisions_total") == 1
    assert sample_value(families, "phase_serve:request_aborted_total") == 1


@pytest.mark.unit
def test_actor_states_are_counted_per_role_with_zeros():
    families = list(text_string_to_metric_families(_metrics().render().decode()))
    assert sample_value(families, "phase_serve:actors", role="decode", state="ready") == 1
    assert sample_value(families, "phase_serve:actors", role="decode", state="dead") == 1
    assert sample_value(families, "phase_serve:actors", role="decode", state="failed") == 0
    assert sample_value(families, "phase_serve:actors", role="prefill", state="starting") == 1
    assert sample_value(families, "phase_serve:actor_restarts_total", actor="decode-0", role="decode") == 2


@pytest.mark.unit
def test_each_registry_labels_its_own_model_and_drops_created():
    first, second = _metrics(), ServerMetrics(EngineStats, "other", 1024)
    first.http_response("/health", "GET", 503)
    second.record(RequestRecord("SISO", "colocated", 3, 2, ("stop",), 0.1))
    for metrics, model in ((first, "m"), (second, "other")):
        samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
        assert samples and {s.labels["model_name"] for s in samples} == {model}
        assert not [s for s in samples if s.name.endswith("_created")]
    assert sample_value(list(text_string_to_metric_families(first.render().decode())),
                        "phase_serve:http_requests_total", handler="/health", status="503") == 1
