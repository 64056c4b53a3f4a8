"""How often a stream's outputs go out: every new token, or fewer and larger outputs when many streams run.

Kept free of torch so that the `serve` flags can name its defaults without loading the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

AUTO_OUTPUTS_PER_STEP = 2  # under `auto`, about this many streams get an output per engine step
# or, where the time between steps is known, about this many outputs a second: the same as two a step at the
# 20-50 ms steps of 4-64 decoding streams, and every token once a step is slow (a long prompt's chunk beside the
# decodes), where holding one would double the gap a reader sees for an output rate that costs nothing. Backed by
# the CPU an event costs (`python -m bench.serve_latency --server-flags "--stream-interval 1"`, 8 streams): on a
# 2-core Zen 5 EPYC 0.15-0.19 ms in the server and 0.4 ms in an openai client on the same host, on a Zen 4 EPYC
# 0.15 and 0.37 ms: 100 a second are 5-6% of one core (docs/performance.md, "The server against the embedded engine").
AUTO_OUTPUTS_PER_SECOND = 100
AUTO_MAX_TOKENS = 8  # and no stream waits for more new tokens than this
# nor longer than this since its last output: where a step is slow (a long prompt's chunk runs beside the
# decodes), holding tokens would multiply the gap a reader sees, and saves nothing worth it
AUTO_MAX_WAIT_S = 0.25


@dataclass(frozen=True)
class StreamInterval:
    """How many new tokens a stream's output waits for before it is emitted; a request's first token and every
    finish are never held. `every=None` is `auto`: enough tokens per output to keep about AUTO_OUTPUTS_PER_SECOND
    outputs a second over all streams (AUTO_OUTPUTS_PER_STEP a step where the step time is not known), at most
    AUTO_MAX_TOKENS, and no token held once AUTO_MAX_WAIT_S has passed since the stream's last output.
    Each output costs the front end, and a client on the same host, a fixed amount of CPU; on a CPU host that
    time comes out of the engine's own cores, so many streams of one token per output slow every step."""

    every: int | None = 1

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"a stream interval must be at least 1 token, got {self.every}")

    @staticmethod
    def parse(value: str | int) -> "StreamInterval":
        """'auto', or a number of tokens."""
        if value == "auto":
            return StreamInterval(None)
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(f"a stream interval is 'auto' or a number of tokens, got {value!r}") from None
        return StreamInterval(tokens)

    @property
    def max_wait(self) -> float | None:
        """Seconds after a stream's last output past which a new token goes out whatever `tokens` says (None: a
        fixed interval holds to its count)."""
        return AUTO_MAX_WAIT_S if self.every is None else None

    def tokens(self, active_streams: int, step_seconds: float | None = None) -> int:
        """New tokens an output waits for, with `active_streams` streams and steps `step_seconds` apart (None:
        not known)."""
        if self.every is not None:
            return self.every
        per_output = active_streams / AUTO_OUTPUTS_PER_STEP if step_seconds is None else \
            active_streams / (AUTO_OUTPUTS_PER_SECOND * max(step_seconds, 1e-6))
        return min(AUTO_MAX_TOKENS, max(1, math.ceil(per_output)))
