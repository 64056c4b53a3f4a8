"""A plain-Python reference for the sampler's logit controls: loops over the vocabulary, one row at a time, in
float64, written from vLLM's definitions rather than from engine/sampling/sampler.py. The batched sampler is tested
against it."""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from engine.sampling.sampling_params import SamplingParams

NEG_INF = float("-inf")


def adjusted_logits(logits: Sequence[float], params: SamplingParams, prompt: Sequence[int],
                    output: Sequence[int], banned: Sequence[int] = ()) -> list[float]:
    """logit_bias added, bans to -inf, then the repetition penalty on tokens of prompt or output, then the
    frequency penalty per output occurrence and the presence penalty once per output token."""
    x = [float(v) for v in logits]
    for token, bias in params.logit_bias:
        x[token] += bias
    for token in banned:
        x[token] = NEG_INF
    counts = Counter(output)
    seen = set(prompt) | set(output)
    for v in range(len(x)):
        if v in seen:
            x[v] = x[v] / params.repetition_penalty if x[v] > 0 else x[v] * params.repetition_penalty
        x[v] -= params.frequency_penalty * counts[v]
        if counts[v] > 0:
            x[v] -= params.presence_penalty
    return x


def _softmax(x: Sequence[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) if v != NEG_INF else 0.0 for v in x]
    total = sum(e)
    return [v / total for v in e]


def distribution(logits: Sequence[float], params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                 banned: Sequence[int] = ()) -> list[float]:
    """The probabilities one sampling step draws from: greedy rows a point mass on the first maximum; else
    temperature, then min-p against the top probability, then top-k, then top-p over what is left."""
    x = adjusted_logits(logits, params, prompt, output, banned)
    vocab = len(x)
    if params.greedy:
        best = max(range(vocab), key=lambda v: (x[v], -v))
        return [1.0 if v == best else 0.0 for v in range(vocab)]
    z = [v / params.temperature for v in x]
    if params.min_p > 0:
        p = _softmax(z)
        threshold = params.min_p * max(p)
        z = [NEG_INF if p[v] < threshold else z[v] for v in range(vocab)]
    order = sorted(range(vocab), key=lambda v: -z[v])  # stable: ties keep the lower id first
    keep = set(order)
    if params.top_k > 0:
        keep = set(order[:params.top_k])
    if params.top_p < 1.0:
        p = _softmax([z[v] if v in keep else NEG_INF for v in range(vocab)])
        mass, nucleus = 0.0, set()
        for v in order:
            if v in keep and mass < params.top_p:
                nucleus.add(v)
                mass += p[v]
        keep = nucleus
    return _softmax([z[v] if v in keep else NEG_INF for v in range(vocab)])
