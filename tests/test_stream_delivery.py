"""What a streaming client receives when several tokens are ready at once (speculative decoding, held stop
strings, a stream interval that groups tokens): every token once, in order, with the text of the whole
response, and one inter-token-latency observation per delivered token. The real `cli.py serve` with a decode
actor, read with the official openai client."""
from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import ServerProcess, TINY_ENGINE_FLAGS, openai_client, start_server

MODEL = "tiny-test"
PROMPTS = ["the river runs over the stones and the stones", "one two three four one two three four one two",
           "copper winter garden thunder paper orbit"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("delivery") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--speculative", "ngram",
                        "--speculate-quadrants", "all", "--stream-interval", "3", "--trace-tokens")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _streamed(client, **kwargs) -> tuple[str, list[list[str]], int]:
    """-> (text, the tokens of each chunk, usage's completion tokens)."""
    text, per_chunk, usage = "", [], None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                           logprobs=0, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                per_chunk.append(chunk.choices[0].logprobs.tokens)
    return text, per_chunk, usage


def test_a_stream_carries_every_token_once_in_order_with_the_whole_text(client):
    for prompt in PROMPTS:
        body = dict(prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(model=MODEL, **body)
        text, per_chunk, usage = _streamed(client, **body)
        assert text == whole.choices[0].text and usage == whole.usage.completion_tokens == 40
        tokens = [t for chunk in per_chunk for t in chunk]
        assert len(tokens) == usage and "".join(tokens) == text
        assert len(per_chunk[0]) == 1 and max(len(c) for c in per_chunk) > 1  # first alone, then grouped


def test_a_stop_string_held_back_across_tokens_ends_the_stream_exactly_there(client):
    for prompt in PROMPTS:
        body = dict(prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        free = client.completions.create(model=MODEL, **body).choices[0].text
        stop = free[len(free) // 2:len(free) // 2 + 5]  # five characters from the middle: several tokens
        whole = client.completions.create(model=MODEL, stop=[stop], **body)
        text, per_chunk, _ = _streamed(client, stop=[stop], **body)
        assert whole.choices[0].finish_reason == "stop"
        assert text == whole.choices[0].text == free[:free.index(stop)]
        assert "".join(t for chunk in per_chunk for t in chunk).startswith(text)


def test_traced_chunks_carry_their_hops_in_order(client):
    stamps = []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, stream=True):
        read = time.monotonic()
        if chunk.choices and chunk.choices[0].text:
            stamps.append([*chunk.model_extra["phase_serve_trace"], read])
    assert len(stamps) >= 4
    for s in stamps:  # step done, sent, received, detokenised, handed to the socket, read here
        assert len(s) == 6 and s == sorted(s)
    assert [s[0] for s in stamps] == sorted(s[0] for s in stamps)


def _itl_and_tpot_counts(server: ServerProcess) -> tuple[float, float]:
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").body.decode())}
    count = {name: sum(s.value for s in families["phase_serve:" + name].samples if s.name.endswith("_count"))
             for name in ("inter_token_latency_seconds", "time_per_output_token_seconds")}
    return count["inter_token_latency_seconds"], count["time_per_output_token_seconds"]


def test_the_itl_histogram_counts_one_observation_per_delivered_token(server, client):
    itl_before, tpot_before = _itl_and_tpot_counts(server)
    _, per_chunk, usage = _streamed(client, prompt=PROMPTS[1], max_tokens=29, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert usage == 29 and max(len(c) for c in per_chunk) > 1
    itl_after, tpot_after = _itl_and_tpot_counts(server)
    assert itl_after - itl_before == usage - 1
    assert tpot_after - tpot_before == 1
