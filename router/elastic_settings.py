"""The settings of an elastic layout: the latency targets the planner serves, whether it may change actors' roles,
and when the last decode role is taken over. The `serve` flags among them are generated from these fields
(engine.flags); the rest are set in code. Kept light to import: cli.py builds every parser up front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import ConfigError
from engine.flags import option

ElasticMode = Literal["off", "on"]


@dataclass(frozen=True)
class ElasticSettings:
    elastic: ElasticMode = option(
        "off", "on: a planner in the router watches the traffic mix and latencies and changes prefill actors into "
        "decode actors and back (colocated <-> disaggregated), or puts one decode actor on every actor's cores, "
        "when its cost model predicts more requests within "
        "--slo-ttft / --slo-itl; off: the layout stays as started (the planner's view is still in /status). Off by "
        "default until `python -m bench.elastic` shows on a machine that its switches pay")
    slo_ttft: float = option(1.0, "the time-to-first-token target of a request whose prompt is short (seconds)")
    slo_ttft_long: float = option(3.0, "the time-to-first-token target of a request whose prompt is long (seconds; "
                                  "long: at least the long-prompt threshold)")
    slo_itl: float = option(0.1, "the inter-token latency target: a request's mean time per output token after "
                            "the first (seconds); each actor also cuts a step that carries decodes (a long prompt's "
                            "chunk beside them) to about this long, from the step times it measures")
    degrade: bool = option(True, "when the last decode actor is lost and none serves again within "
                           "--degrade-after seconds (a crash loop, a Ray node gone with no room left), a prefill "
                           "actor takes the decode role, colocated, instead of every request failing")
    degrade_after: float = option(5.0, "seconds without any decode actor before a prefill actor takes its role (at "
                                  "once when the lost actors are crash-looping)")
    plan_interval: float = 5.0  # seconds between the planner's decisions
    window: float = 30.0  # seconds of traffic each decision looks at, and the horizon a switch must pay off within
    margin: float = 0.15  # a switch needs a predicted goodput at least this fraction above the current layout's
    dwell: int = 3  # consecutive decisions that must agree on a better layout before it is taken
    cooldown: float = 30.0  # seconds after a switch before the next one
    min_requests: int = 8  # finished requests a window needs before its observed latencies count
    long_prompt_tokens: int = 512  # a prompt at least this long is long-in (when its request's treatment says not)
    long_output_tokens: int = 256  # max_tokens at least this large is long-out
    change_timeout: float = 120.0  # seconds an actor gets to change role before it is restarted in its old role
    switch_seconds: float = 5.0  # a role change's cost in seconds until one has been measured

    def __post_init__(self) -> None:
        for name in ("slo_ttft", "slo_ttft_long", "slo_itl", "plan_interval", "window", "change_timeout",
                     "switch_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.degrade_after < 0 or self.margin < 0 or self.cooldown < 0:
            raise ConfigError("degrade_after, margin and cooldown must not be negative, got "
                              f"{self.degrade_after}, {self.margin}, {self.cooldown}")
        if self.dwell < 1 or self.min_requests < 1:
            raise ConfigError(f"dwell and min_requests must be at least 1, got {self.dwell}, {self.min_requests}")
        if self.elastic not in ("off", "on"):
            raise ConfigError(f"elastic must be off or on, got {self.elastic!r}")

    @property
    def on(self) -> bool:
        return self.elastic == "on"
