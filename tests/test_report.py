"""bench/report.py: small synthetic results of every bench, written by the benches' own JSON writers where they
import cheaply, make a page with its sections, headline numbers and valid PNG plots; a malformed or unknown input
is an error that names the file."""
from __future__ import annotations

import argparse
import json
import os
import struct
from pathlib import Path

import pytest

from bench import load_test, report, serve_latency, workloads
from bench.provenance import provenance

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_test_json(path: Path, concurrency: int, tokens_per_s: float) -> Path:
    cfg = load_test.LoadConfig("http://127.0.0.1:8000", concurrency, 4, 16)
    results = [load_test.RequestResult(True, 1.0 + i / 10, 0.1 * (i + 1), [0.02, 0.03, 0.0, 0.05], 16)
               for i in range(4)]
    rep = load_test.summarise(results, 4 * 16 / tokens_per_s)
    argv = ["--concurrency", str(concurrency), "--json", str(path)]
    path.write_text(json.dumps(load_test.result_json(cfg, rep, results, provenance("load_test", argv))))
    return path


def _record(server: str, index: int, quadrant: str, ttft: float, gap: float) -> workloads.RequestRecord:
    sent = index * 0.5
    times = [sent + ttft + k * gap for k in range(8)]
    record = workloads.RequestRecord(server, index, quadrant, sent, 64, 8, sent=sent, prompt_tokens=66,
                                     output_tokens=8, usage_reported=True, token_times=times)
    workloads.finish_record(record, times[-1] + 0.001)
    return record


def _workloads_json(path: Path, servers: dict[str, float], origin: dict) -> Path:
    """One run per server at rate 1; server name -> its TTFT scale."""
    slo = workloads.Slo()
    results = []
    for server, scale in servers.items():
        records = [_record(server, i, q, scale * (i + 1) / 10, 0.02 * scale)
                   for i, q in enumerate(("siso", "liso", "silo", "lilo") * 2)]
        target = workloads.Target(server, "http://127.0.0.1:8000")
        results.append(workloads.make_result(target, "rate 1", 1.0, 5.0, records, slo))
    config = {"mix": {"label": "all"}, "slo": {"ttft": 2.0, "tpot": 0.2, "target": 0.9}, "itl_under_bursts": False}
    goodputs = workloads.goodputs_of(results, slo.target)
    return workloads.write_json(path, {**origin, "config": config}, results, goodputs)


def _offline_json(path: Path) -> Path:
    doc = {**provenance("offline_throughput", ["--batch-sizes", "1,8", "--json", str(path)]),
           "args": {"input_len": 128, "output_len": 128, "dtype": "bfloat16"},
           "ours": [{"batch": 1, "tokens_per_s": 40.5, "ttft_p50_ms": 30.0, "tpot_p50_ms": 24.0, "error": None},
                    {"batch": 8, "tokens_per_s": 210.25, "ttft_p50_ms": 90.0, "tpot_p50_ms": 35.0, "error": None}],
           "hf": {"1": {"batch": 1, "tokens_per_s": 20.0}, "8": {"batch": 8, "tokens_per_s": 95.0}}}
    path.write_text(json.dumps(doc))
    return path


def _serve_latency_json(path: Path) -> Path:
    args = argparse.Namespace(streams="1,4", max_tokens=32, input_len=64, rounds=2, in_process=False, model=None,
                              server_flags="", json=str(path), trace=False, stream_counts=[1, 4])
    side = serve_latency.Side
    rows = {1: ([side(1, 20.0, 50.0), side(1, 22.0, 45.0)], [side(1, 23.0, 43.0), side(1, 25.0, 40.0)]),
            4: ([side(4, 30.0, 133.0), side(4, 32.0, 125.0)], [side(4, 34.0, 117.5), side(4, 36.0, 111.0)])}
    path.write_text(json.dumps(serve_latency.result_json(args, rows, provenance("serve_latency", ["--streams", "1,4"]))))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    return {
        "load": [_load_test_json(src / f"load_c{c}.json", c, 10.0 * c) for c in (1, 2, 4)],
        "workloads": _workloads_json(src / "mixed.json", {"server": 1.0}, provenance("workloads", ["--mix", "all"])),
        "placement": _workloads_json(src / "placement.json", {"never": 1.0, "auto": 2.0},
                                     {**provenance("placement", ["--policies", "never,auto"]),
                                      "policies": {"never": ["--disagg", "never"], "auto": ["--disagg", "auto"]}}),
        "offline": _offline_json(src / "offline.json"),
        "serve": _serve_latency_json(src / "serve.json"),
    }


def test_every_kind_makes_one_page_with_plots(tmp_path, inputs):
    files = [*inputs["load"], inputs["workloads"], inputs["placement"], inputs["offline"], inputs["serve"]]
    out = tmp_path / "out"
    assert report.main([*map(str, files), "--out", str(out)]) == 0
    page = (out / "report.md").read_text()
    for heading in ("# Benchmark report", "## Inputs", "## Headline numbers", "### Load test",
                    "### Workloads: mix all against server", "### Placement comparison: mix all against auto, never",
                    "### Offline throughput", "### Server against embedded engine", "## Throughput against concurrency",
                    "## Latency distributions", "## Placement comparison"):
        assert heading in page, heading
    for f in files:
        assert f"`{f.name}`" in page
    assert "`python -m bench.load_test --concurrency 4 --json " in page
    assert "`python -m bench.placement --policies never,auto`" in page
    assert "| load_c4.json | http://127.0.0.1:8000 (chat, 16 tokens per request) | 4 | 4 | 0 |" in page
    assert "| 40.0 |" in page  # output tokens/s at concurrency 4
    assert "| 8 | 210.2 | 95.0 |" in page  # offline batch 8: ours, Hugging Face
    assert "| serve.json | actors | 4 | 31.00 | 35.00 | 129.0 | 114.2 |" in page  # medians of the two rounds
    assert "| never | rate 1 | all | 8 | 0 |" in page and "SLO met" in page
    images = sorted(line[line.index("(") + 1:-1] for line in page.splitlines() if line.startswith("!["))
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert images == pngs and len(pngs) == 5, (images, pngs)
    assert {"throughput.png", "load_test_cdf.png", "mixed_quadrant_cdf.png", "placement_quadrant_cdf.png",
            "placement_comparison.png"} == set(pngs)
    for name in pngs:
        width, height = _png_size(out / name)
        assert width >= 400 and height >= 250, name
        assert 5_000 < (out / name).stat().st_size < 200_000, name


def test_one_load_test_alone(tmp_path, inputs):
    out = tmp_path / "out"
    report.build_report([inputs["load"][0]], out)
    page = (out / "report.md").read_text()
    assert "## Placement comparison" not in page and "### Offline throughput" not in page
    assert sorted(p.name for p in out.glob("*.png")) == ["load_test_cdf.png", "throughput.png"]


@pytest.mark.parametrize("content, words", [
    ("{not json", "not a JSON file"),
    ("[1, 2]", "holds a list"),
    ('{"config": {}}', 'no "bench" key'),
    ('{"bench": "kv_transfer"}', "unknown bench 'kv_transfer'"),
    ('{"bench": "load_test", "config": {}}', "a load_test result without 'report', 'requests'"),
    ('{"bench": "load_test", "config": {}, "report": {}, "requests": []}', "unexpected shape"),
    ('{"bench": "workloads", "runs": [{"server": "s"}]}', "unexpected shape"),
    ('{"bench": "workloads", "runs": []}', "with no runs"),
])
def test_bad_input_names_the_file(tmp_path, inputs, capsys, content, words):
    bad = tmp_path / "broken_result.json"
    bad.write_text(content)
    out = tmp_path / "out"
    assert report.main([str(inputs["load"][0]), str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and words in err, err
    assert not out.exists()  # every input is read before anything is written


def test_missing_file_names_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert report.main([str(missing), "--out", str(tmp_path / "out")]) == 2
    assert str(missing) in capsys.readouterr().err


def test_every_bench_json_says_which_bench_and_how(inputs):
    for path in [inputs["load"][0], inputs["workloads"], inputs["placement"], inputs["serve"]]:
        doc = json.loads(path.read_text())
        assert doc["bench"] in report.REQUIRED and doc["argv"] and doc["command"].startswith("python -m bench.")
        assert doc["timestamp"].endswith("+00:00")
    requests = json.loads(inputs["load"][0].read_text())["requests"]
    assert len(requests) == 4 and requests[0]["ttft"] == pytest.approx(0.1) and requests[0]["itls"]


def test_serve_latency_gives_cpu_per_event_where_measured():
    """The median over rounds of CPU time per stream event; None where no round measured it (in process, or a
    round that read no event)."""
    side = serve_latency.Side
    rounds = [side(8, 17.0, 470.0, 1000, 150.0, 300.0), side(8, 18.0, 460.0, 1000, 130.0, 280.0),
              side(8, 18.0, 460.0, 500, 90.0, 160.0)]
    assert serve_latency.per_event_ms(rounds, "server_cpu_ms") == pytest.approx(0.15)
    assert serve_latency.per_event_ms(rounds, "client_cpu_ms") == pytest.approx(0.30)
    assert serve_latency.per_event_ms([side(8, 17.0, 470.0, 1000)], "server_cpu_ms") is None
    assert serve_latency.per_event_ms([side(8, 17.0, 470.0, 0, 10.0, 10.0)], "client_cpu_ms") is None
    assert serve_latency.cpu_seconds(None) == 0.0 and serve_latency.cpu_seconds(os.getpid()) > 0
