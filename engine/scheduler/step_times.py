"""What this engine's steps take, learnt from its own steps, so that a step carrying decodes can be cut to an
inter-token latency target (`SchedulerLimits.itl_target`).

A decoding stream's gap between tokens is the step that made them: a step that also runs a long prompt's chunk
of the whole 512-token budget takes 0.4-0.5 s on a 2-core CPU with SmolLM2-135M, 40x a step of decodes alone.
The model is two numbers, each an exponential average over recent steps:

- `decode_seconds`: a step of decodes only;
- `unit_seconds`: a prefill budget unit (`SchedulerLimits.run_cost`: a prompt token, plus its attention over
  its context in steps shared with other work), from steps with at least `MIN_UNITS` of them, less the decode
  part where decodes ran beside.

Measured rather than taken from the start-up calibration: what a unit costs moves with the prompt's depth, the
weights' format, the batch and whatever else the host runs, and the engine sees every step anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_UNITS = 16  # a step teaches the per-unit cost only with this many prefill units; a cut step keeps at least these
SMOOTHING = 0.25  # weight of the newest step in each average


@dataclass
class StepTimes:
    decode_seconds: float | None = None
    unit_seconds: float | None = None
    # a layer of a long prompt's chunk run layer by layer, per budget unit of the chunk (its tokens and their
    # attention: a chunk deeper in its prompt takes longer a layer, known before its first layer runs)
    layer_unit_seconds: float | None = None

    def observe_layers(self, count: int, units: int, seconds: float) -> None:
        """`count` layers of a chunk of `units` budget units took `seconds`."""
        if count > 0 and units > 0:
            self.layer_unit_seconds = _average(self.layer_unit_seconds, seconds / (count * units))

    def layers_within(self, seconds: float, units: int) -> int:
        """Layers of a chunk of `units` budget units that fit in `seconds` (at least one; one until a layer has
        been seen)."""
        if not self.layer_unit_seconds or seconds <= 0 or units <= 0:
            return 1
        return max(1, int(seconds / (self.layer_unit_seconds * units)))

    def observe(self, decodes: int, units: int, seconds: float) -> None:
        """One finished step: `decodes` decode rows, `units` prefill budget units, `seconds` it took."""
        if decodes and not units:
            self.decode_seconds = _average(self.decode_seconds, seconds)
        elif units >= MIN_UNITS:
            beside = self.decode_seconds if decodes and self.decode_seconds is not None else 0.0
            self.unit_seconds = _average(self.unit_seconds, max(seconds - beside, 0.0) / units)

    def units_within(self, target: float) -> int | None:
        """Prefill units a step beside decodes may take and still last about `target` seconds (at least
        MIN_UNITS, so a prefill always progresses); None until both parts have been seen."""
        if self.decode_seconds is None or not self.unit_seconds:
            return None
        return max(MIN_UNITS, int((target - self.decode_seconds) / self.unit_seconds))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
