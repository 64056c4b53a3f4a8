"""What the supervisor tells an actor process at start: its role, device share and engine options."""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path


class Role(StrEnum):
    """An actor's role; the value is what specs and Hello messages carry."""

    PREFILL = "prefill"
    DECODE = "decode"
    DRAFT = "draft"


ROLES = tuple(r.value for r in Role)


@dataclass(frozen=True)
class ActorSpec:
    actor_id: str
    role: Role
    device: str = "cpu"  # "cpu" or "cuda:N"
    threads: int = 1  # torch threads; on a CPU-only host the actors' threads sum to the cores
    cpus: tuple[int, ...] = ()  # CPU affinity (empty: inherit)
    socket_path: str = ""  # the Unix socket the actor listens on (inside the supervisor's 0700 directory)
    engine: dict = field(default_factory=dict)  # EngineConfig keyword arguments
    remote: bool = False  # joined over TCP from another host: its KV pool cannot be mapped here
    # Placed on a Ray node (actors.ray_actors): it joins over TCP like a remote worker, but still shares its KV
    # pool with peers on its own node (and offers a KV endpoint to the others)
    ray: bool = False
    # A remote decode actor's KV endpoint, HOST:PORT, where prefill actors stream pages ("": the address it
    # joins from, a free port; "off": none, the router relays the pages)
    kv_listen: str = ""
    draft_actor: str = ""  # a decode actor's draft actor (same supervisor), if drafts come from one
    trace: bool = False  # stamp token frames with step-done and sent times (serve --trace-tokens)
    share_kv: bool = False  # a decode actor whose KV pool prefill actors write into: export it (shared memory)
    # The calibration a previous process of this actor measured (Calibration.to_wire): a replacement reuses it
    # instead of measuring again, since the spec (model, device share, engine options) is the same.
    calibration: dict | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"actor role must be one of {', '.join(ROLES)}, got {self.role!r}")
        object.__setattr__(self, "role", Role(self.role))
        if self.threads < 1:
            raise ValueError(f"actor threads must be positive, got {self.threads}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "ActorSpec":
        raw = json.loads(text)
        raw["cpus"] = tuple(raw.get("cpus", ()))
        return ActorSpec(**raw)

    def child_environment(self) -> dict[str, str]:
        """Thread and device settings that must be in place before the child imports torch. OpenMP keeps its
        default wait policy (spin briefly, then sleep; sleep at once when its threads outnumber the cores):
        a passive policy puts a futex wake-up behind each of a decode step's barriers."""
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        if self.device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = self.device.split(":", 1)[1]
        return env

    @property
    def draft_socket(self) -> str:
        """Where this decode actor's draft actor listens: beside its own socket, as the supervisor lays them out."""
        if not self.draft_actor or not self.socket_path:
            return ""
        return str(Path(self.socket_path).parent / socket_name(self.draft_actor))

    @property
    def pool_socket(self) -> str:
        """Where this decode actor hands its shared KV pool's descriptor to prefill actors (beside its socket)."""
        return str(Path(self.socket_path).with_name(f"{self.actor_id}.kv.sock")) if self.socket_path else ""

    @property
    def error_path(self) -> str:
        """Where the actor leaves the reason it could not start, for its supervisor to report."""
        return str(Path(self.socket_path).with_name(f"{self.actor_id}.error")) if self.socket_path else ""

    @property
    def local_device(self) -> str:
        """Inside the child, a GPU is always cuda:0 (CUDA_VISIBLE_DEVICES narrows it to one)."""
        return "cuda:0" if self.device.startswith("cuda") else "cpu"


NODE_ID_ENV = "PHASE_SERVE_NODE_ID"  # set by the Ray actor wrapper: the Ray node this actor runs on
NODE_ADDRESS_ENV = "PHASE_SERVE_NODE_ADDRESS"


def node_identity() -> tuple[str, str]:
    """(node id, node address) that this process reports in Hello: its Ray node's, else its host's name."""
    return (os.environ.get(NODE_ID_ENV) or f"host:{socket.gethostname()}", os.environ.get(NODE_ADDRESS_ENV, ""))


def socket_name(actor_id: str) -> str:
    """The file name of a local actor's socket inside its supervisor's private directory."""
    return f"{actor_id}.sock"


def split_cores(num_actors: int, total: int | None = None) -> list[tuple[int, ...]]:
    """Give each actor a disjoint share of the cores (at least one each; shares wrap when there are more
    actors than cores)."""
    cores = sorted(os.sched_getaffinity(0)) if total is None else list(range(total))
    if num_actors <= 0:
        return []
    if num_actors > len(cores):
        return [(cores[i % len(cores)],) for i in range(num_actors)]
    size = len(cores) // num_actors
    return [tuple(cores[i * size:(i + 1) * size]) if i < num_actors - 1 else tuple(cores[i * size:])
            for i in range(num_actors)]
