"""The HTTP server, end to end: the real `cli.py serve` in a subprocess, driven by the official openai client
and by raw HTTP; plus fast in-process tests of validation, quadrants, stream chunks and draining."""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HfTokenizer

from engine import AsyncLLM
from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.app import create_app
from server.context import CONTEXT
from server.errors import ApiError
from server.main import backend_summary, drain
from server.protocol import ModelLimits, parse_chat, parse_completion, parse_json_body, sampling_params
from server.quadrant import Quadrant, QuadrantThresholds, classify
from server.settings import ServerSettings
from tests.server_utils import REPO, TINY_ENGINE_FLAGS, ServerProcess, start_server, wait_until

MODEL = "tiny-test"
CONTEXT_LEN = 1024  # the tiny model's max_position_embeddings


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("server") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def served():
    """Successful generation requests sent to `server` so far (the TTFT histogram must count exactly these)."""
    return {"ok": 0}


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return HfTokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _complete(client, served, **kwargs):
    out = client.completions.create(model=MODEL, **kwargs)
    served["ok"] += 1
    return out


def _chat(client, served, **kwargs):
    out = client.chat.completions.create(model=MODEL, **kwargs)
    served["ok"] += 1
    return out


HI = [{"role": "user", "content": "Hello, how are you today?"}]
LONG = {"ignore_eos": True}


# ---------------------------------------------------------------------------------------- openai client

def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_shape_usage_and_request_id(client, served, tokenizer):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello world", max_tokens=7,
                                                       temperature=0, extra_body=LONG)
    served["ok"] += 1
    out = raw.parse()
    assert out.id.startswith("cmpl-") and raw.headers["x-request-id"] == out.id
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.prompt_tokens == len(tokenizer.encode("Hello world").ids)
    assert (out.usage.completion_tokens, out.usage.total_tokens) == (7, 7 + out.usage.prompt_tokens)


def test_token_id_prompt_matches_text_prompt_and_logprobs(client, served, tokenizer):
    ids = tokenizer.encode("The quick brown fox").ids
    by_text = _complete(client, served, prompt="The quick brown fox", max_tokens=6, temperature=0, extra_body=LONG)
    by_ids = _complete(client, served, prompt=ids, max_tokens=6, temperature=0, logprobs=3, extra_body=LONG)
    assert by_ids.choices[0].text == by_text.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    # up to 3 alternatives plus the sampled token (fewer when two tokens spell the same text)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert [top[tok] for top, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs
    assert all(top[tok] == max(top.values()) for top, tok in zip(lp.top_logprobs, lp.tokens))  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_completion_with_logprobs(client, served):
    out = _chat(client, served, messages=HI, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                extra_body=LONG)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 6 and len(choice.logprobs.content) == 6
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes).decode("utf-8") == entry.token


def test_streaming_chat_with_usage_matches_non_streaming(client, served):
    whole = _chat(client, served, messages=HI, max_tokens=12, temperature=0, extra_body=LONG)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=LONG))
    served["ok"] += 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion(client, served):
    whole = _complete(client, served, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body=LONG)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                            stream=True, extra_body=LONG))
    served["ok"] += 1
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client, served):
    full = _complete(client, served, prompt="The quick brown fox", max_tokens=24, temperature=0,
                     extra_body=LONG).choices[0].text
    k = next(i for i in range(1, len(full) - 1) if full[i:i + 2].isalnum() and full.find(full[i:i + 2]) == i)
    stopped = _complete(client, served, prompt="The quick brown fox", max_tokens=24, temperature=0,
                        stop=[full[k:k + 2]], extra_body=LONG).choices[0]
    assert (stopped.text, stopped.finish_reason) == (full[:k], "stop")


def test_seed_reproducibility(client, served):
    def sample(seed):
        return _complete(client, served, prompt="Hello", max_tokens=12, temperature=1.0, seed=seed,
                         extra_body=LONG).choices[0].text
    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first or sample(7) != first


def test_n_samples(client, served):
    out = _chat(client, served, messages=HI, max_tokens=8, temperature=1.0, n=2, seed=5, extra_body=LONG)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.choices[0].message.content != out.choices[1].message.content


# ---------------------------------------------------------------------------------------- bad input

def _ids(n):
    return [5] * n


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["one", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": _ids(CONTEXT_LEN)}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999], "min_tokens": 2}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages"),
]


def _engine_counters(server: ServerProcess) -> dict[str, float]:
    families = text_string_to_metric_families(server.get("/metrics").body.decode())
    wanted = ("phase_serve:prompt_tokens", "phase_serve:request_aborted", "phase_serve:request_success")
    return {f.name: sum(s.value for s in f.samples if s.name.endswith("_total")) for f in families
            if f.name in wanted}


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_with_openai_error(server, path, body, status, param):
    result = server.post(path, body)
    assert result.status == status, result.body
    error = result.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert result.headers["X-Request-Id"]


def test_bad_input_never_reaches_the_engine(server):
    before = _engine_counters(server)
    for path, body, _, _ in BAD:
        server.post(path, body)
    assert _engine_counters(server) == before


def test_body_over_the_limit_is_413(server):
    result = server.post("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert result.status == 413 and result.json()["error"]["code"] == "body_too_large"


def test_unknown_route_and_wrong_method(server):
    missing = server.get("/v1/nothing")
    assert missing.status == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    wrong = server.get("/v1/completions")
    assert wrong.status == 405 and wrong.headers["Allow"] == "POST" and "error" in wrong.json()


# ---------------------------------------------------------------------------------------- disconnects, status

def _open_stream(url: str, body: dict, headers: dict | None = None) -> tuple[http.client.HTTPConnection, object]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def _data_lines(response, count: int) -> list[bytes]:
    lines = []
    while len(lines) < count:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data:"):
            lines.append(line)
    return lines


def _status(server: ServerProcess) -> dict:
    return server.get("/status").json()


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = _engine_counters(server)
    conn, response = _open_stream(server.url, {"prompt": "Hello", "max_tokens": 1000, "stream": True,
                                               "ignore_eos": True})
    assert response.status == 200 and len(_data_lines(response, 3)) == 3
    # the server's status aggregates the actors' heartbeats, so it may lag by a heartbeat
    assert wait_until(lambda: _status(server)["running"] == 1, 5.0)
    conn.close()
    assert wait_until(lambda: (s := _status(server))["running"] == 0 and s["kv_blocks"]["used"] == 0, 5.0)
    after = _engine_counters(server)
    assert after["phase_serve:request_aborted"] == before["phase_serve:request_aborted"] + 1
    assert after["phase_serve:request_success"] == before["phase_serve:request_success"]


def test_status_shape(server):
    status = _status(server)
    assert (status["model"], status["dtype"], status["waiting"]) == (MODEL, "float32", 0)
    assert status["kv_blocks"]["total"] == 256
    assert set(status["prefix_cache"]) == {"queries", "hits"} and status["preemptions"] >= 0
    assert status["backend"] is None  # the engine runs in the decode actor, whose entry names its backend
    assert [(a["backend"]["backend"], a["backend"]["kernels"]) for a in status["actors"]] == [("torch", [])]  # fp32


def test_the_start_up_line_names_the_backend(server):
    assert f"on {server.url} (torch)" in server.log()


@pytest.mark.unit
def test_backend_summary_names_each_backend_once():
    vectors = {"backend": "cpu-kernels", "matrix_engine": "vectors"}
    torch_ops = {"backend": "torch", "matrix_engine": None}
    assert backend_summary(vectors, []) == "cpu-kernels (vectors)"
    actors = [{"backend": vectors}, {"backend": vectors}, {"backend": torch_ops}, {"backend": None}]
    assert backend_summary(None, actors) == "cpu-kernels (vectors), torch"
    assert backend_summary(None, [{"backend": None}]) == "no engine ready"


def test_metrics_count_every_successful_request(server, served, client):
    _complete(client, served, prompt="Count me", max_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").body.decode())}
    ttft = families["phase_serve:time_to_first_token_seconds"]
    counts = [s for s in ttft.samples if s.name.endswith("_count")]
    assert sum(s.value for s in counts) == served["ok"] > 0
    assert {s.labels["path"] for s in counts} == {"colocated"} and {s.labels["quadrant"] for s in counts} == {"SISO"}
    success = families["phase_serve:request_success"].samples
    assert sum(s.value for s in success if s.name.endswith("_total")) == served["ok"]
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens"):
        assert "phase_serve:" + name in families, name
    assert families["phase_serve:num_requests_running"].samples[0].value == 0


# ---------------------------------------------------------------------------------------- API key, 429, SIGTERM

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, tmp_path_factory):
    """A short-lived server with an API key (from the environment), one request slot and a grace period."""
    proc = start_server(tmp_path_factory.mktemp("keyed") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--max-queue", "1", "--grace-period", "30",
                        env={"PHASE_SERVE_API_KEY": KEY})
    yield proc
    proc.stop(signal.SIGKILL)


def test_api_key(keyed_server):
    import openai

    body = {"prompt": "Hello", "max_tokens": 2}
    missing = keyed_server.post("/v1/completions", body)
    wrong = keyed_server.post("/v1/completions", body, headers={"Authorization": "Bearer nope"})
    for result in (missing, wrong):
        assert result.status == 401 and result.json()["error"]["code"] == "invalid_api_key"
    assert keyed_server.get("/health").status == 200  # only /v1 needs the key
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2).choices


def test_the_key_is_accepted_as_x_api_key_and_refused_in_anthropics_shape_on_messages(keyed_server):
    import anthropic

    model = keyed_server.get("/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]
    client = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEY, max_retries=0, timeout=60)
    reply = client.messages.create(model=model, max_tokens=2, messages=HI)
    assert reply.type == "message" and 1 <= reply.usage.output_tokens <= 2  # the random model may end at once
    body = {"max_tokens": 2, "messages": HI}
    wrong = keyed_server.post("/v1/messages", body, headers={"x-api-key": "nope"})
    assert wrong.status == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in wrong.json()["error"]["message"]
    completion = keyed_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"x-api-key": KEY})
    assert completion.status == 200 and completion.json()["object"] == "text_completion"


def test_queue_full_then_sigterm_drains_in_flight_stream(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    conn, stream = _open_stream(keyed_server.url, {"prompt": "Hello", "max_tokens": 900, "stream": True,
                                                   "ignore_eos": True}, auth)
    assert len(_data_lines(stream, 1)) == 1
    busy = keyed_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=auth)
    assert busy.status == 429 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"
    keyed_server.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: keyed_server.get("/health").status == 503, 10.0)
    refused = keyed_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=auth)
    assert refused.status == 503 and refused.json()["error"]["code"] == "shutting_down"
    rest = stream.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]") and '"error"' not in rest
    assert rest.count('"finish_reason":"length"') == 1
    assert keyed_server.proc.wait(30) == 0, keyed_server.log()


# ---------------------------------------------------------------------------------------- in-process

LIMITS = ModelLimits(MODEL, 100, 512)


def _param_of(call) -> str | None:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == 400
    return info.value.param


@pytest.mark.unit
def test_parsing_builds_sampling_params():
    req = parse_chat({"messages": HI, "max_completion_tokens": 5, "temperature": 0, "stop": "x", "seed": 3,
                      "logprobs": True, "top_logprobs": 2, "priority": -1, "stream": True,
                      "stream_options": {"include_usage": True}}, MODEL)
    params = sampling_params(req.sampling, 10, LIMITS)
    assert (params.max_tokens, params.temperature, params.stop, params.seed, params.logprobs) == (5, 0, ("x",), 3, 2)
    assert (req.chat, req.stream, req.include_usage, req.priority) == (True, True, True, -1)
    completion = parse_completion({"prompt": [[1, 2, 3]]}, MODEL)
    assert completion.prompt == (1, 2, 3) and completion.sampling.params.max_tokens == 16


@pytest.mark.unit
def test_parsing_names_the_parameter():
    assert _param_of(lambda: parse_json_body(b'"text"')) is None
    assert _param_of(lambda: parse_completion({"prompt": "x", "seed": 1 << 70}, MODEL)) == "seed"
    assert _param_of(lambda: parse_completion({"prompt": "x", "ignore_eos": 1}, MODEL)) == "ignore_eos"
    assert _param_of(lambda: parse_chat({"messages": HI, "top_logprobs": 2}, MODEL)) == "top_logprobs"
    assert _param_of(lambda: parse_chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                        MODEL)) == "messages[0].content"
    fields = parse_completion({"prompt": "x", "max_tokens": 95}, MODEL).sampling
    assert _param_of(lambda: sampling_params(fields, 10, LIMITS)) == "max_tokens"
    assert _param_of(lambda: parse_completion({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, MODEL)) == \
        "min_tokens"
    fields = parse_completion({"prompt": "x", "min_tokens": 12}, MODEL).sampling  # max_tokens: 16 by default
    assert _param_of(lambda: sampling_params(fields, 95, LIMITS)) == "min_tokens"  # capped at the 5 left


@pytest.mark.unit
def test_quadrants():
    assert classify(10, 10) is Quadrant.SISO and classify(512, 255) is Quadrant.LISO
    assert classify(511, 256) is Quadrant.SILO and classify(4096, 1024) is Quadrant.LILO
    assert classify(100, 100, QuadrantThresholds(long_prompt_tokens=64, long_output_tokens=64)) is Quadrant.LILO


@pytest.fixture
def tiny_llm(tiny_model_dir):
    """An in-process engine; each test gets its own, since it binds to the test's event loop."""
    llm = AsyncLLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=8, num_threads=1)
    yield llm
    llm.shutdown()


async def test_drain_aborts_requests_that_outlive_the_grace_period(tiny_llm):
    app = create_app(tiny_llm, ServerSettings(grace_period=0.2))
    async with TestServer(app) as test_server, aiohttp.ClientSession() as session:
        body = {"prompt": "Hello", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        async with session.post(test_server.make_url("/v1/completions"), json=body) as resp:
            assert (await resp.content.readline()).startswith(b"data:")
            await drain(app[CONTEXT], asyncio.Event(), app[CONTEXT].log)
            rest = (await resp.read()).decode()
    assert '"code":"shutting_down"' in rest and rest.rstrip().endswith("data: [DONE]")
    assert '"message":"server shutting down"' in rest

    def freed() -> bool:  # the stream ends at once; the engine drops the request at its next step
        stats = tiny_llm.stats()
        return (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)

    deadline = time.monotonic() + 30
    while not freed() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert freed()


async def test_a_bug_is_a_500_logged_with_the_request_id(tiny_llm, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("boom")
        yield  # an async generator, like AsyncLLM.generate

    tiny_llm.generate = broken
    async with TestServer(create_app(tiny_llm, ServerSettings())) as test_server, aiohttp.ClientSession() as session:
        async with session.post(test_server.make_url("/v1/completions"), json={"prompt": "Hi"}) as resp:
            status, body, request_id = resp.status, await resp.json(), resp.headers["X-Request-Id"]
    assert status == 500 and body["error"]["type"] == "server_error" and request_id in body["error"]["message"]
    logged = [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "unhandled error"]
    assert [entry["request_id"] for entry in logged] == [request_id]
    assert "RuntimeError: boom" in caplog.text


@pytest.mark.engine
async def test_a_bug_on_messages_is_a_500_or_an_error_event_in_anthropics_shape(tiny_llm, caplog):
    async def fails_after_one_output(token_ids, params, **kwargs):
        sample = CompletionOutput(0, "Hi", [5], None, None, "Hi", [5])
        yield RequestOutput(kwargs["request_id"], None, list(token_ids), [sample], RequestMetrics(time.monotonic()))
        raise RuntimeError("boom")

    async def fails_at_once(*args, **kwargs):
        raise RuntimeError("boom")
        yield  # an async generator, like AsyncLLM.generate

    body = {"max_tokens": 4, "messages": HI}
    async with TestServer(create_app(tiny_llm, ServerSettings())) as test_server, aiohttp.ClientSession() as session:
        tiny_llm.generate = fails_at_once
        async with session.post(test_server.make_url("/v1/messages"), json=body) as resp:
            whole, request_id = (resp.status, await resp.json()), resp.headers["X-Request-Id"]
        tiny_llm.generate = fails_after_one_output
        async with session.post(test_server.make_url("/v1/messages"), json=body | {"stream": True}) as resp:
            streamed = (resp.status, (await resp.read()).decode())
    assert whole[0] == 500 and whole[1]["type"] == "error" and whole[1]["error"]["type"] == "api_error"
    assert request_id in whole[1]["error"]["message"] and "RuntimeError: boom" in caplog.text
    assert streamed[0] == 200 and streamed[1].startswith("event: message_start")
    last = streamed[1].strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"


@pytest.mark.engine
async def test_truncate_prompt_tokens_runs_the_last_k_tokens(tiny_llm):
    prompt = [3 + i % 500 for i in range(CONTEXT_LEN + 50)]  # past the context: a 400 unless truncated
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with TestServer(create_app(tiny_llm, ServerSettings())) as test_server, aiohttp.ClientSession() as session:
        async def post(path: str, body: dict) -> tuple[int, dict]:
            async with session.post(test_server.make_url(path), json=greedy | body) as resp:
                return resp.status, await resp.json()

        whole = await post("/v1/completions", {"prompt": prompt})
        truncated = await post("/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 12})
        direct = await post("/v1/completions", {"prompt": prompt[-12:]})
        chat = await post("/v1/chat/completions", {"messages": HI, "truncate_prompt_tokens": 5})
        bad = await post("/v1/chat/completions", {"messages": HI, "truncate_prompt_tokens": 0})
    assert whole[0] == 400 and whole[1]["error"]["code"] == "context_length_exceeded"
    assert truncated[0] == direct[0] == 200 and truncated[1]["usage"]["prompt_tokens"] == 12
    assert truncated[1]["choices"][0]["text"] == direct[1]["choices"][0]["text"]
    assert chat[0] == 200 and chat[1]["usage"]["prompt_tokens"] == 5
    assert bad[0] == 400 and bad[1]["error"]["param"] == "truncate_prompt_tokens"


def test_a_busy_port_fails_before_the_model_loads(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "cli.py", "serve", "--port", str(port), "--model", str(tiny_model_dir),
                               *TINY_ENGINE_FLAGS, "--log-format", "json"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "starting engine" not in done.stderr and "decode-0" not in done.stderr  # nothing loaded or spawned
