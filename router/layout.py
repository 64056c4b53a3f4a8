"""Which actors to run: how many of each role, on which devices, and the spec each one starts from; and whether
what they will hold fits in this host's memory, said before any of them starts."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from actors.ray_options import RayOptions
from actors.spec import ActorSpec, Role, split_cores
from engine.config import ConfigError, EngineConfig
from engine.model.footprint import Footprint, available_memory, check_resident, engine_footprint, total
from engine.model.loader import ModelSource, resolve_dtype
from router.placement import PlacementMode
from transport import load_secret

log = logging.getLogger("router")


@dataclass(frozen=True)
class ActorLayout:
    """How many actors of each role, on which devices (empty: CPU, cores split between them)."""

    prefill_actors: int = 0
    decode_actors: int = 0
    devices: tuple[str, ...] = ()
    disagg: PlacementMode = "auto"
    listen_workers: str | None = None  # HOST:PORT where workers on other hosts join (secret: $PHASE_SERVE_SECRET)
    draft_actors: int = 0  # with speculative="draft": draft model processes (0: the draft runs in each decode actor)
    trace_tokens: bool = False  # decode actors stamp their token frames (serve --trace-tokens)
    ray: RayOptions | None = None  # place the actors on a Ray cluster (serve --ray)
    elastic: bool = False  # the planner may change actors between prefill and decode (serve --elastic on)

    def __post_init__(self) -> None:
        if self.prefill_actors < 0 or self.decode_actors < 0 or self.draft_actors < 0:
            raise ValueError("actor counts must not be negative")
        if self.draft_actors and not self.decode_actors:
            raise ValueError("draft actors need at least one decode actor to draft for")
        if self.prefill_actors and not self.decode_actors and self.listen_workers is None:
            raise ValueError("prefill actors need a decode actor (or --listen-workers for remote ones) to hand "
                             "their KV to")
        if self.ray is not None:
            self._check_ray()
        if self.elastic and self.prefill_actors + self.decode_actors < 2:
            raise ConfigError("--elastic on needs at least two prefill and decode actors to share between the roles "
                              f"(--prefill-actors {self.prefill_actors} --decode-actors {self.decode_actors})")
        if self.elastic and self.draft_actors:
            raise ConfigError("--elastic on runs no draft actors: a decode actor made from a prefill actor would have "
                             "none; leave --draft-actors at 0 (the draft model then runs inside each decode actor)")

    def _check_ray(self) -> None:
        if not self.decode_actors:
            raise ValueError("--ray needs at least one decode actor")
        if self.listen_workers is not None:
            raise ValueError("--ray and --listen-workers are two ways to run actors elsewhere; give one")
        if self.draft_actors:
            raise ValueError("draft actors are not placed on Ray; leave --draft-actors at 0 with --ray (the draft "
                             "model then runs inside each decode actor)")

    @property
    def uses_actors(self) -> bool:
        return self.decode_actors > 0 or self.listen_workers is not None

    @property
    def hands_off_kv(self) -> bool:
        """Whether a prefill actor may write into the decode actors' pools: only then are they exported (with an
        elastic layout, a decode actor may become a prefill actor and write into its peers')."""
        return self.prefill_actors > 0 or self.listen_workers is not None or self.elastic

    def listen_address(self) -> tuple[str, int, bytes] | None:
        if self.listen_workers is None:
            return None
        host, port = self.listen_workers.rsplit(":", 1)
        return host, int(port), load_secret()


def actor_specs(layout: ActorLayout, engine_options: dict) -> list[ActorSpec]:
    """Prefill actors first, then decode actors, then draft actors (with speculative="draft" only); each gets
    one listed device, or on a CPU-only host a disjoint share of the cores (threads = share size). Decode actor
    i takes its drafts from draft actor i mod the number of draft actors."""
    num_drafts = layout.draft_actors if engine_options.get("speculative") == "draft" else 0
    roles = [Role.PREFILL] * layout.prefill_actors + [Role.DECODE] * layout.decode_actors + [Role.DRAFT] * num_drafts
    counters = dict.fromkeys(Role, 0)
    shares = split_cores(len(roles)) if layout.ray is None else [()] * len(roles)  # Ray: no host to split
    specs = []
    for i, role in enumerate(roles):
        index = counters[role]
        counters[role] += 1
        device = layout.devices[i % len(layout.devices)] if layout.devices else "cpu"
        cpus = () if device != "cpu" else shares[i]
        threads = max(len(cpus), 1) if layout.ray is None else max(int(layout.ray.num_cpus), 1)
        options = dict(engine_options, num_threads=threads)
        draft_actor = f"draft-{index % num_drafts}" if role is Role.DECODE and num_drafts else ""
        if role is Role.DRAFT:
            options = _draft_options(options, layout.decode_actors, num_drafts, index)
        specs.append(ActorSpec(f"{role}-{index}", role, device, threads, cpus, "", options,
                               draft_actor=draft_actor, trace=layout.trace_tokens,
                               share_kv=role is Role.DECODE and layout.hands_off_kv,
                               remote=layout.ray is not None, ray=layout.ray is not None))
    return specs


def _draft_options(options: dict, num_decodes: int, num_drafts: int, index: int) -> dict:
    """A draft actor holds draft KV for every sequence of the decode actors it serves."""
    served = len(range(index, num_decodes, num_drafts))
    if options.get("num_kv_blocks") and served > 1:
        return dict(options, num_kv_blocks=options["num_kv_blocks"] * served)
    return options


def local_footprint(specs: list[ActorSpec], source: ModelSource, available: int,
                    elastic: bool = False) -> tuple[Footprint, int]:
    """What the actors that hold their model in this host's memory (on its CPU, not remote nor on Ray) will hold
    once loaded, and how many they are: each prefill and decode actor its copy of the weights, each decode actor
    its KV pool (a prefill actor writes into theirs; with `elastic`, any of them may become a decode actor). Draft
    actors are not counted (engine/model/footprint.py)."""
    local = [s for s in specs if s.role in (Role.PREFILL, Role.DECODE) and not s.remote
             and torch.device(s.device).type == "cpu"]
    parts = []
    for spec in local:
        config = EngineConfig(**spec.engine)
        dtype = resolve_dtype(config.dtype, spec.device)
        parts.append(engine_footprint(source, config, dtype, available, kv_pool=elastic or spec.role is Role.DECODE))
    return total(parts), len(local)


def check_local_memory(specs: list[ActorSpec], source: ModelSource, elastic: bool = False) -> None:
    """Log what the local actors will hold, and refuse (engine.model.footprint.InsufficientMemoryError, one
    sentence with the numbers) before any of them starts when it exceeds the memory available."""
    available = available_memory()
    footprint, count = local_footprint(specs, source, available, elastic)
    if count:
        check_resident(footprint, available, log, f"by {count} actor{'s' if count > 1 else ''} on this host")
