"""The server on a prefill + decode actor pair: placement headers, actor status, failover seen over HTTP."""
from __future__ import annotations

import os
import signal

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import TINY_ENGINE_FLAGS, start_server, wait_until

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("actors") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--prefill-actors", "1",
                        "--decode-actors", "1", "--disagg", "always")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_responses_carry_quadrant_and_placement(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                                      temperature=0, extra_body={"ignore_eos": True})
    assert raw.headers["X-Quadrant"] == "SISO"
    assert raw.headers["X-Placement"].startswith("disaggregated; decode=decode-0; prefill=prefill-0")
    assert raw.parse().usage.completion_tokens == 8


def test_long_output_request_is_silo(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=200, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert raw.headers["X-Quadrant"] == "SILO"


def test_status_lists_actors_and_calibration(server):
    status = server.get("/status").json()
    actors = {a["id"]: a for a in status["actors"]}
    assert {a["role"] for a in actors.values()} == {"prefill", "decode"}
    assert all(a["state"] == "ready" and a["pid"] and a["pid"] != server.proc.pid for a in actors.values())
    assert set(status["calibration"]) == set(actors)
    assert status["calibration"]["prefill-0"]["prefill_seconds_512"] > 0
    assert all(a["backend"]["backend"] == "torch" for a in actors.values())  # fp32 engines: plain torch ops
    assert status["backend"] is None  # no engine in the server process


def test_metrics_label_the_disaggregated_path(server, client):
    client.completions.create(model=MODEL, prompt="Count", max_tokens=3, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").body.decode())}
    paths = {s.labels["path"] for s in families["phase_serve:time_to_first_token_seconds"].samples}
    assert "disaggregated" in paths


def test_killed_decode_actor_makes_health_503_then_recovers(server, client):
    decode = next(a for a in server.get("/status").json()["actors"] if a["role"] == "decode")
    os.kill(decode["pid"], signal.SIGKILL)
    assert wait_until(lambda: server.get("/health").status == 503, 10.0)
    assert wait_until(lambda: server.get("/health").status == 200, 60.0)
    actors = {a["id"]: a for a in server.get("/status").json()["actors"]}
    assert actors["decode-0"]["restarts"] == 1 and actors["decode-0"]["pid"] != decode["pid"]
    out = client.completions.create(model=MODEL, prompt="Back again", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
