"""bench/gpu_check.py's dry run, in a subprocess as a person would run it on a machine without a GPU: every part
runs (tiny stand-in models on the CUDA backend with the Triton kernels interpreted, CUDA graphs through the CPU
stand-in for a capture, the IPC hand-off through shared memory, a pytest run) and the JSON holds every figure a
GPU run's does, none of them failed or skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAST_TEST = "tests/test_cuda_graphs.py::test_buckets_double_to_eight_then_step_by_eight_up_to_the_batch"


def test_the_dry_run_runs_every_part_and_writes_sane_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--batches", "1,2", "--steps", "1",
               "--prompt-tokens", "8", "--prefill-tokens", "16", "--out", str(out), "--shapes-dir",
               str(tmp_path / "shapes"), "--tests", FAST_TEST]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["errors"] == [] and results["skipped"] == [], results["errors"]
    assert results["dry_run"] is True and results["bench"] == "gpu_check" and results["seconds"] > 0
    assert results["hbm"]["gb_per_s"] > 0 and results["matmul"]["tflops"] > 0
    assert set(results["models"]) == {"default", "llama-3.2-1b"}
    for model in results["models"].values():
        assert model["backend"]["backend"] == "cuda" and model["graph_buckets"] == [1, 2]
        points = {(p["batch"], p["graphs"]): p for p in model["decode"]}
        assert set(points) == {(1, True), (1, False), (2, True), (2, False)}
        assert all(p["tokens_per_step"] == batch and p["tok_per_s"] > 0 and 0 < p["fraction_of_bound"]
                   for (batch, _), p in points.items())
        assert model["graph_replays"] == {"1": 3, "2": 3}  # warm-up and timed steps replayed; eager ones not
        assert set(model["graph_speedup"]) == {"1", "2"} and model["largest_over_batch1"] > 0
        assert model["prefill"]["tokens"] == 16 and model["prefill"]["tflops"] > 0
        streamed = model["streamed_prefill"]  # every page of the one 16-token block left, in both variants
        assert streamed["bytes"] == model["kv_bytes_per_token"] * 16
        assert streamed["staged"]["over_plain"] > 0 and streamed["device_views"]["over_plain"] > 0
    assert results["attention"]["faster"] == "triton" and results["attention"]["triton"]["us"] > 0
    assert results["ipc"]["kind"] == "shm" and results["ipc"]["verified"] is True
    sampler = results["sampler"]  # the branch-free distribution, uncompiled, gives the plain one's values
    assert sampler["compiled"] is False and sampler["warm_up_seconds"] >= 0
    assert all(sampler[v]["max_abs_diff"] == 0 and sampler[v]["fused_us"] > 0 for v in ("temperature", "top_k_top_p"))
    assert (results["tests"]["tests"], results["tests"]["failures"], results["tests"]["errors"]) == (1, 0, 0)
    assert set(results["goals"]) == {"1b_batch1_within_2x_of_hbm", "largest_batch_10x_batch1",
                                     "graphs_1_5x_eager_at_batch1", "meaningful"}
    assert results["goals"]["meaningful"] is False
    assert set(results["part_seconds"]) == {"hbm", "matmul", "model_paths", "default", "llama-3.2-1b", "attention",
                                            "sampler", "ipc", "tests", "goals"}
