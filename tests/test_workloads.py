"""bench/workloads.py: the pure parts (no server): statistics, goodput, arrivals, mixes, lengths, SSE parsing."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from bench.workloads import (
    ArrivalPlan, LengthRange, Mix, PromptMaker, RequestRecord, Slo, SseDecoder, attainment, build_workload,
    Target, burst_itl, burst_times, burst_windows, duplicate_url_warnings, ecdf, estimated_words, finish_record,
    goodput, itls, meets_slo, parse_event, parse_mix, parse_rates, parse_targets, percentile, placement_path,
    poisson_arrivals, quadrant_specs, resolve_context, ServerInfo, split_itls, summarise, token_note)


def record(quadrant: str = "siso", ttft: float | None = 0.1, tpot: float | None = 0.05, error: str | None = None,
           token_times: list[float] | None = None, burst: int | None = None, **kw) -> RequestRecord:
    r = RequestRecord("s", 0, quadrant, 0.0, 10, 8, burst=burst, error=error, **kw)
    r.ttft, r.tpot, r.e2e = ttft, tpot, 1.0
    r.token_times = token_times or []
    return r


# ------------------------------------------------------------------------------------------------ statistics
def test_percentile_interpolates_and_is_nan_when_empty():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 90) == 3.0
    assert math.isnan(percentile([], 50))


def test_slo_needs_both_objectives_and_counts_errors_as_misses():
    slo = Slo(ttft=1.0, tpot=0.1)
    assert meets_slo(record(ttft=1.0, tpot=0.1), slo)
    assert not meets_slo(record(ttft=1.01, tpot=0.01), slo)
    assert not meets_slo(record(ttft=0.1, tpot=0.2), slo)
    assert not meets_slo(record(error="HTTP 500"), slo)
    assert meets_slo(record(ttft=0.5, tpot=None), slo)  # one output token: no TPOT to judge
    records = [record(), record(ttft=5.0), record(error="boom"), record()]
    assert attainment(records, slo) == 0.5


def test_summary_per_quadrant_and_overall():
    records = ([record("siso", ttft=0.1 * i, tpot=0.01 * i, token_times=[0.0, 0.1, 0.3]) for i in range(1, 11)]
               + [record("liso", ttft=3.0, tpot=0.02), record("liso", error="timeout")])
    out = summarise(records, Slo(ttft=0.55, tpot=1.0))
    assert list(out) == ["siso", "liso", "all"]
    assert out["siso"].count == 10 and out["siso"].errors == 0
    assert out["siso"].ttft_p50 == pytest.approx(0.55)
    assert out["siso"].tpot_p90 == pytest.approx(0.091)
    assert out["siso"].itl_p50 == pytest.approx(0.15)  # gaps 0.1 and 0.2, ten times each
    assert out["siso"].slo_attainment == 0.5
    assert out["liso"].errors == 1 and out["liso"].slo_attainment == 0.0
    assert out["all"].count == 12 and out["all"].slo_attainment == pytest.approx(5 / 12)


def test_summary_leaves_out_cut_off_streams():
    out = summarise([record(), record(cut_off=True)], Slo())
    assert out["all"].count == 1


def test_finish_record_ttft_tpot_and_chunk_fallback():
    r = RequestRecord("s", 0, "siso", 0.0, 10, 4, sent=1.0, token_times=[1.5, 1.6, 1.8, 2.0])
    finish_record(r, end=2.5)
    assert r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(1.5)
    assert r.output_tokens == 4  # no usage chunk: counted from chunks
    assert r.tpot == pytest.approx((2.5 - 1.5) / 3)
    assert itls(r) == pytest.approx([0.1, 0.2, 0.2])
    u = RequestRecord("s", 0, "siso", 0.0, 10, 8, sent=0.0, token_times=[1.0, 2.0], output_tokens=9,
                      usage_reported=True)
    finish_record(u, end=3.0)
    assert u.output_tokens == 9 and u.tpot == pytest.approx(2.0 / 8)


# ------------------------------------------------------------------------------------------------ goodput
def test_goodput_interpolates_the_crossing():
    g = goodput([(4, 0.5), (0.5, 1.0), (2, 0.8), (1, 0.95)], target=0.9)
    assert g.rates == (0.5, 1, 2, 4)
    assert g.max_passing_rate == 1
    assert g.interpolated_rate == pytest.approx(1 + (0.95 - 0.9) / (0.95 - 0.8) * 1)
    assert not g.all_pass and g.monotonic


def test_goodput_edges():
    all_pass = goodput([(1, 0.95), (2, 0.9)])
    assert all_pass.all_pass and all_pass.max_passing_rate == 2 and all_pass.interpolated_rate == 2
    none_pass = goodput([(1, 0.5), (2, 0.2)])
    assert none_pass.max_passing_rate == 0 and none_pass.interpolated_rate == 0
    bumpy = goodput([(1, 0.95), (2, 0.7), (4, 0.92)])
    assert bumpy.max_passing_rate == 1 and not bumpy.monotonic
    with pytest.raises(ValueError):
        goodput([])


# ------------------------------------------------------------------------------------------------ arrivals
def test_poisson_mean_rate_and_determinism():
    times = poisson_arrivals(np.random.default_rng(7), rate=4.0, duration=500.0)
    assert len(times) / 500.0 == pytest.approx(4.0, rel=0.05)
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)  # exponential: std == mean
    assert times == sorted(times) and times[-1] <= 500.0
    assert times == poisson_arrivals(np.random.default_rng(7), rate=4.0, duration=500.0)


def test_poisson_count_and_bad_arguments():
    assert len(poisson_arrivals(np.random.default_rng(0), rate=1.0, count=12)) == 12
    assert len(poisson_arrivals(np.random.default_rng(0), rate=1.0, duration=1e9, count=5)) == 5
    for kwargs in ({"rate": 0.0, "count": 3}, {"rate": 1.0}):
        with pytest.raises(ValueError):
            poisson_arrivals(np.random.default_rng(0), **kwargs)


def test_burst_times():
    assert burst_times(10, 30) == [10, 20]
    assert burst_times(10, 30.5) == [10, 20, 30]
    assert burst_times(10, 5) == []


def test_arrival_plan_validation():
    for kwargs in ({"rate": -1, "count": 3}, {"rate": 1}, {"rate": 1, "duration": 0}, {"rate": 1, "count": 0},
                   {"rate": 1, "count": 1, "burst_size": 0}):
        with pytest.raises(ValueError):
            ArrivalPlan(**kwargs)


# ------------------------------------------------------------------------------------------------ mixes
def test_parse_mix_weights_are_normalised():
    mix = parse_mix("siso=0.8,liso=0.2")
    assert dict(mix.weights) == pytest.approx({"siso": 0.8, "liso": 0.2}) and mix.burst_quadrant is None
    assert dict(parse_mix(" LILO=3 , siso=1 ").weights) == pytest.approx({"siso": 0.25, "lilo": 0.75})
    assert parse_mix("silo").weights == (("silo", 1.0),)
    assert parse_mix("siso=1,liso=0").weights == (("siso", 1.0),)


def test_named_mixes():
    assert dict(parse_mix("chat").weights) == pytest.approx({"siso": 0.7, "silo": 0.3})
    bursts = parse_mix("chat+liso-bursts")
    assert bursts.weights == (("siso", 1.0),) and bursts.burst_quadrant == "liso"
    assert dict(parse_mix("all").weights) == pytest.approx({q: 0.25 for q in ("siso", "liso", "silo", "lilo")})
    custom = parse_mix("chat+lilo-bursts")
    assert dict(custom.weights) == pytest.approx({"siso": 0.7, "silo": 0.3}) and custom.burst_quadrant == "lilo"


@pytest.mark.parametrize("spec, message", [
    ("", "unknown quadrant"), ("foo=1", "unknown quadrant"), ("siso=x", "not a number"),
    ("siso=-1", ">= 0"), ("siso=nan", ">= 0"), ("siso=1,siso=2", "twice"), ("siso=0,liso=0", "sum to zero"),
    ("siso=1+bursts", "QUADRANT-bursts"), ("siso=1+xx-bursts", "QUADRANT-bursts"),
    ("siso+liso-bursts+lilo-bursts", "at most one"),
])
def test_parse_mix_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mix(spec)


def test_mix_sampling_follows_weights():
    specs = quadrant_specs(8192)
    mix = Mix((("siso", 0.8), ("liso", 0.2)))
    workload = build_workload(mix, ArrivalPlan(rate=50.0, count=2000), specs, _NoText(), seed=1)
    share = sum(w.quadrant == "siso" for w in workload) / len(workload)
    assert share == pytest.approx(0.8, abs=0.03)


# ------------------------------------------------------------------------------------------------ lengths
class _NoText(PromptMaker):
    def make(self, key, n_tokens):  # the tests of shapes do not need the text
        return ""


def test_quadrant_ranges_default_context():
    specs = quadrant_specs(8192, max_long_in=2048, max_long_out=512)
    assert (specs["siso"].prompt, specs["siso"].output) == (LengthRange(16, 128), LengthRange(8, 32))
    assert specs["liso"].prompt == LengthRange(1024, 2048)  # U[ctx/4, ctx/2] capped at 2048, spread kept
    assert specs["silo"].output == LengthRange(128, 512)
    assert (specs["lilo"].prompt, specs["lilo"].output) == (LengthRange(1024, 2048), LengthRange(128, 512))


def test_quadrant_ranges_scale_with_context_and_fit():
    for context in (1024, 2048, 4096, 32768):
        specs = quadrant_specs(context, max_long_in=10**6, max_long_out=256)
        lilo = specs["lilo"]
        assert lilo.prompt.hi + lilo.output.hi <= context
        assert lilo.prompt.lo > 128 and lilo.output.lo > 32
    assert quadrant_specs(4096, max_long_in=10**6)["liso"].prompt == LengthRange(1024, 2048)
    assert quadrant_specs(8192, max_long_out=200)["silo"].output == LengthRange(128, 200)
    with pytest.raises(ValueError):
        quadrant_specs(512)
    with pytest.raises(ValueError):
        quadrant_specs(8192, max_long_out=32)


def test_sampled_lengths_stay_in_range_and_repeat_with_the_seed():
    specs = quadrant_specs(8192)
    mix = parse_mix("all")
    workload = build_workload(mix, ArrivalPlan(rate=10.0, count=400), specs, _NoText(), seed=3)
    for w in workload:
        spec = specs[w.quadrant]
        assert spec.prompt.lo <= w.prompt_tokens <= spec.prompt.hi
        assert spec.output.lo <= w.max_tokens <= spec.output.hi
    assert {w.quadrant for w in workload} == {"siso", "liso", "silo", "lilo"}
    again = build_workload(mix, ArrivalPlan(rate=10.0, count=400), specs, _NoText(), seed=3)
    assert again == workload
    other = build_workload(mix, ArrivalPlan(rate=10.0, count=400), specs, _NoText(), seed=4)
    assert other != workload


def test_bursts_are_added_on_top_of_the_base_stream():
    specs = quadrant_specs(8192)
    plan = ArrivalPlan(rate=2.0, duration=35.0, burst_every=10.0, burst_size=3)
    workload = build_workload(parse_mix("chat+liso-bursts"), plan, specs, _NoText(), seed=0)
    bursts = [w for w in workload if w.burst is not None]
    assert [w.arrival for w in bursts] == [10.0] * 3 + [20.0] * 3 + [30.0] * 3
    assert {w.quadrant for w in bursts} == {"liso"} and {w.burst for w in bursts} == {1, 2, 3}
    assert {w.quadrant for w in workload if w.burst is None} == {"siso"}
    assert [w.arrival for w in workload] == sorted(w.arrival for w in workload)
    assert [w.index for w in workload] == list(range(len(workload)))


def test_prompt_text_is_english_deterministic_and_sized():
    maker = PromptMaker()
    text = maker.make((0, 1, 2), 130)
    assert text == maker.make((0, 1, 2), 130) and text != maker.make((0, 1, 3), 130)
    assert len(text.split()) == estimated_words(130) == 100
    assert text[0].isupper() and all(re.fullmatch(r"[A-Za-z]+[,.]?", word) for word in text.split())
    assert "estimated" in maker.method


def test_prompt_text_with_a_tokenizer_is_cut_exactly(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()  # words and punctuation are separate tokens
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    maker = PromptMaker(str(tmp_path))
    text = maker.make((5,), 57)
    assert len(tok.encode(text, add_special_tokens=False).ids) == 57
    assert "exact" in maker.method


# ------------------------------------------------------------------------------------------------ SSE
_STREAM = (b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"Hello","finish_reason":null}],'
           b'"usage":null}\n\n'
           b': keep-alive comment\n\n'
           b'data: {"choices":[{"index":0,"text":" wor\xc3\xa9ld","finish_reason":null}]}\r\n\r\n'
           b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
           b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n'
           b'data: [DONE]\n\n')


@pytest.mark.parametrize("piece", [1, 3, 7, 64, len(_STREAM)])
def test_sse_decoder_handles_any_split(piece):
    decoder = SseDecoder()
    payloads = [p for i in range(0, len(_STREAM), piece) for p in decoder.feed(_STREAM[i:i + piece])]
    assert len(payloads) == 5
    events = [parse_event(p) for p in payloads]
    assert [e.text for e in events] == ["Hello", " woréld", "", "", ""]
    assert events[3].usage == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert events[4].done and not any(e.done for e in events[:4])
    assert all(e.error is None for e in events)


def test_sse_multiline_data_and_chat_deltas():
    decoder = SseDecoder()
    assert decoder.feed(b"event: x\ndata: a\ndata:b\n") == []
    assert decoder.feed(b"\n") == ["a\nb"]
    chat = parse_event('{"choices":[{"index":0,"delta":{"content":"Hi"}}]}')
    assert chat.text == "Hi"


def test_parse_event_errors():
    assert "boom" in parse_event('{"error": {"message": "boom", "type": "x"}}').error
    assert parse_event("not json").error.startswith("unparseable")
    assert parse_event("[1, 2]").error is not None


# ------------------------------------------------------------------------------------------------ bursts
def test_itl_split_by_burst_windows():
    burst = record("liso", burst=1, token_times=[3.0])
    burst.sent = 1.0
    stream = record("silo", token_times=[0.0, 0.5, 1.5, 2.9, 3.1, 3.3])
    windows = burst_windows([burst, stream])
    assert windows == [(1.0, 3.0)]
    inside, outside = split_itls([burst, stream], windows)
    assert inside == pytest.approx([1.0, 1.4, 0.2])  # gaps touching (1.0, 3.0)
    assert outside == pytest.approx([0.5, 0.2])
    b = burst_itl([burst, stream])
    assert b.bursts == 1 and b.itl_in_bursts_max == pytest.approx(1.4) and b.window_mean_s == pytest.approx(2.0)
    assert burst_itl([stream]) is None


# ------------------------------------------------------------------------------------------------ CLI parsing
def test_parse_targets_and_rates():
    assert [t.name for t in parse_targets("http://h:1", None)] == ["server"]
    targets = parse_targets("http://ignored", "never=http://127.0.0.1:8001, auto=http://127.0.0.1:8002/")
    assert [(t.name, t.url) for t in targets] == [("never", "http://127.0.0.1:8001"), ("auto", "http://127.0.0.1:8002")]
    for bad in ("never", "a=http://x,a=http://y", "a=ftp://x", ","):
        with pytest.raises(ValueError):
            parse_targets("http://h", bad)
    assert parse_rates("4,0.5, 1,2") == [0.5, 1, 2, 4]
    for bad in ("", "1,x", "0,1", "-2"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_context_comes_from_the_servers_when_reported():
    assert resolve_context(8192, [ServerInfo()])[0] == 8192
    assert resolve_context(8192, [ServerInfo("m", 4096), ServerInfo("m", 2048)])[0] == 2048


def test_placement_path():
    assert placement_path("disaggregated; decode=d0; prefill=p0") == "disaggregated"
    assert placement_path("colocated") == "colocated"


def test_duplicate_urls_are_flagged():
    assert duplicate_url_warnings([Target("a", "http://h:1"), Target("b", "http://h:2")]) == []
    assert len(duplicate_url_warnings([Target("a", "http://h:1"), Target("b", "http://h:1")])) == 1


def test_ecdf_starts_at_zero():
    xs, ys = ecdf([3.0, 1.0, 2.0])
    assert list(xs) == [1.0, 1.0, 2.0, 3.0] and list(ys) == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_token_note_reports_the_measured_ratio():
    records = [record(), record()]
    assert "no usage" in token_note(records, 1.3)
    records[0].prompt_tokens, records[1].prompt_tokens = 9, 9  # targets are 10
    note = token_note(records, 1.3)
    assert "0.90x" in note and "--tokens-per-word 1.17" in note
    assert "special tokens" in token_note(records, None)


def test_prompt_length_follows_tokens_per_word():
    assert len(PromptMaker(tokens_per_word=1.0).make((1,), 50).split()) == 50
    with pytest.raises(ValueError):
        PromptMaker(tokens_per_word=0)
