"""bench/gguf_quant.py's quantisers against `gguf`'s own (bytes) and its dequantiser (values within each type's
error bound)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from bench.gguf_quant import quantize

Q = gguf.GGMLQuantizationType


def sample_rows(rng: np.random.Generator, k: int = 1024) -> np.ndarray:
    """Rows a quantiser must handle: Gaussian at a weight's scale and at a large one, a heavy tail, a row of zeros,
    a constant positive row (Q4_K's minimum clamps to 0), one value among zeros, and a negative peak."""
    rows = [rng.standard_normal(k) * 0.02, rng.standard_normal(k) * 40, rng.standard_t(2, k), np.zeros(k),
            np.full(k, 0.75), np.eye(1, k, 17)[0] * 3, -np.abs(rng.standard_normal(k))]
    return np.stack(rows).astype(np.float32)


def ulp_bound(x: np.ndarray) -> np.ndarray:
    return np.abs(x) * 2.0**-8  # bf16 keeps 8 significant bits: half an ulp is at most 2^-8 of the value


def q8_0_bound(x: np.ndarray) -> np.ndarray:
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127  # half a step, and d's rounding to fp16
    return np.broadcast_to(0.6 * d, (d.shape[0], 32)).reshape(x.shape)


def q4_0_bound(x: np.ndarray) -> np.ndarray:
    d = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 8  # the peak's opposite clamps to 7 d: one step
    return np.broadcast_to(1.05 * d, (d.shape[0], 32)).reshape(x.shape)


def q4_k_bound(x: np.ndarray) -> np.ndarray:
    """Half of a sub-block's step (max - min(lowest, 0)) / 15, plus what rounding the step and the minimum to 6
    bits of the super-block's largest (63 levels) can add over 15 codes: 9 of its steps, one of its minimums."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    step = (sub.max(axis=2) - low) / 15
    coarse = 9 * step.max(axis=1, keepdims=True) / 63 + (-low).max(axis=1, keepdims=True) / 63
    return np.broadcast_to((step / 2 + coarse)[..., None], sub.shape).reshape(x.shape)


def q6_k_bound(x: np.ndarray) -> np.ndarray:
    """A sub-block's step (its peak / 32: the peak's opposite clamps to 31 steps), plus 33 times half the 8-bit
    scale's step (the largest step / 128) and its fp16 rounding."""
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 32
    coarse = 19 * step.max(axis=1, keepdims=True) / 128
    return np.broadcast_to((step + coarse)[..., None], sub.shape).reshape(x.shape)


BOUNDS = {Q.BF16: (ulp_bound, 0.003), Q.Q8_0: (q8_0_bound, 0.01), Q.Q4_0: (q4_0_bound, 0.1),
          Q.Q4_K: (q4_k_bound, 0.1), Q.Q6_K: (q6_k_bound, 0.03)}  # bound, and RMS error / RMS on Gaussian rows


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0])
def test_bytes_equal_gguf_quantiser(qtype: Q) -> None:
    x = sample_rows(np.random.default_rng(1))
    ours = quantize(x, qtype)
    assert ours.dtype == np.uint8 and ours.shape == gguf.quants.quant_shape_to_byte_shape(x.shape, qtype)
    assert np.array_equal(ours, gguf.quants.quantize(x, qtype))


@pytest.mark.unit
@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda q: q.name)
def test_dequantised_values_within_the_type_bound(qtype: Q) -> None:
    x = sample_rows(np.random.default_rng(2))
    back = gguf.quants.dequantize(quantize(x, qtype), qtype)
    bound, rms = BOUNDS[qtype]
    assert back.shape == x.shape and np.isfinite(back).all()
    excess = np.abs(back - x) - bound(x)
    assert excess.max() <= 0, f"{qtype.name}: {int((excess > 0).sum())} values past the bound"
    assert not back[3].any() and not back[5][x[5] == 0].any()  # zeros stay zeros, beside a peak too
    gaussian = x[0]
    assert np.sqrt(np.mean((back[0] - gaussian) ** 2)) < rms * np.sqrt(np.mean(gaussian ** 2))


@pytest.mark.unit
def test_k_quant_codes_use_the_whole_range() -> None:
    """A layout error that kept values within bounds by luck would still show as unused codes."""
    x = np.random.default_rng(3).standard_normal((8, 4096)).astype(np.float32)
    q4 = quantize(x, Q.Q4_K).reshape(-1, 144)[:, 16:]
    q6 = quantize(x, Q.Q6_K).reshape(-1, 210)
    assert set(np.concatenate([q4 & 15, q4 >> 4]).ravel()) == set(range(16))
    codes = np.concatenate([q6[:, :128] & 15, q6[:, :128] >> 4]).ravel()
    assert set(codes) == set(range(16)) and set((q6[:, 128:192] >> 6).ravel()) == set(range(4))


@pytest.mark.unit
def test_quantize_refuses_rows_that_do_not_split_into_blocks() -> None:
    with pytest.raises(ValueError, match="rows of 320 values do not split into Q4_K blocks of 256"):
        quantize(np.zeros((2, 320), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="no quantiser for Q5_K"):
        quantize(np.zeros((2, 256), np.float32), Q.Q5_K)
