"""bench/kv_tiers.py without a server: the conversations it sends, the flags of each configuration, and the
summary of the turns it measured."""
from __future__ import annotations

import math

import pytest

from bench.kv_tiers import (QUICK, Tiers, Turn, Workload, conversations, documents, parse_args, question,
                            server_flags, settings, summarise)


def test_conversations_open_with_shared_documents_and_grow_turn_by_turn():
    w = Workload(conversations=6, turns=2, documents=3, doc_tokens=100)
    docs, convos = documents(w), conversations(w)
    assert len(set(docs)) == 3 and documents(w) == docs  # distinct, and the same in every configuration
    assert [c.messages[0]["content"].endswith(docs[c.index % 3]) for c in convos] == [True] * 6
    sent = convos[4].ask(question(w, 4, 0))
    convos[4].answered("an answer")
    again = convos[4].ask(question(w, 4, 1))
    assert again[:len(sent)] == sent and again[len(sent)] == {"role": "assistant", "content": "an answer"}
    assert question(w, 4, 0) != question(w, 4, 1) != question(w, 5, 1)


def test_each_configuration_adds_its_tiers_to_the_same_pool():
    tiers = Tiers("96MiB", "192MiB", "4GiB")
    assert server_flags("none", tiers, "/d") == ["--kv-cache-memory", "96MiB"]
    assert server_flags("host", tiers, "/d") == ["--kv-cache-memory", "96MiB", "--kv-host-size", "192MiB"]
    assert server_flags("host+disk", tiers, "/d")[-4:] == ["--kv-disk-dir", "/d", "--kv-disk-size", "4GiB"]


def test_the_summary_counts_computed_prefill_and_skips_failed_turns():
    turns = [Turn(0, 0, 0.5, 1000, 0, 8), Turn(1, 0, 0.1, 1000, 800, 8), Turn(2, 0, 0.3, 1000, 600, 8),
             Turn(3, 0, None, 0, 0, 0, "HTTP 500: boom")]
    s = summarise("host", turns, wall=4.0, status={"kv_tiers": {"host": {"hits": 50}}})
    assert (s.turns, s.errors, s.prefill_tokens, s.cached_tokens, s.output_tokens) == (4, 1, 1600, 1400, 24)
    assert s.ttft_p50 == pytest.approx(0.3) and s.host_hits == 50 and s.disk_hits == 0
    assert s.output_tokens_per_second == 6.0 and s.turns_per_second == 1.0
    assert math.isnan(summarise("none", [], 1.0, {}).ttft_p50)


def test_quick_mode_and_unknown_configurations():
    assert settings(parse_args(["--quick"]))[0] == QUICK
    assert parse_args(["--configs", "none,host"]).configs == ["none", "host"]
    with pytest.raises(SystemExit):
        parse_args(["--configs", "none,gpu"])
