"""bench/real_size.py's quick mode on a tiny Llama shape: a first start that fills the converted-weights cache, a
warm one that maps it, and every figure of the table measured."""
from __future__ import annotations

import json

import pytest

from bench import real_size


def test_quick_mode_measures_a_first_and_a_warm_start(tmp_path, capsys):
    results = real_size.main(["--quick", "--out", str(tmp_path)])
    (result,) = results
    first, warm = result["first"], result["warm"]
    assert (result["shape"], result["format"]) == ("tiny-llama", "q4_k_m")
    assert not first["cache_hit"] and warm["cache_hit"]  # the first start filled the entry the second mapped
    assert "int4" in warm["weight_dtype"]  # Q4_K blocks kept as int4
    for run in (first, warm):
        assert run["ready_s"] > 0 and run["decode_ms"] > 0 and run["bandwidth_gbps"] > 0
        fractions = sorted(run["step_bytes"] / (r["bandwidth_gbps"] * 1e6) / r["decode_ms"] for r in run["rounds"])
        assert len(fractions) == 3 and run["roofline"] == pytest.approx(fractions[1])  # each round, its own bandwidth
        of_read = sorted(run["step_bytes"] / (r["read_gbps"] * 1e6) / r["decode_ms"] for r in run["rounds"])
        assert run["read_gbps"] > 0 and run["of_read_bound"] == pytest.approx(of_read[1])
        assert run["kv"] > 0 and run["weights"] >= run["step_bytes"] > 0
        assert run["rss_load"] > run["kv"]  # the pool is resident once the engine is built
        assert 0 < run["rss_base"] < run["rss_decode"]
        assert run["ratio_decode_engine"] < run["ratio_decode"]  # less the imports' share
    assert json.loads((tmp_path / "real_size.json").read_text()) == results
    assert "| tiny-llama | q4_k_m |" in capsys.readouterr().out
    assert not list(tmp_path.glob("cache-*"))  # the run's cache directory is removed
