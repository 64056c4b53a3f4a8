"""How `serve --ray` places the actors on a Ray cluster: which cluster, and what each role's actor reserves.

Plain data, importable without Ray (actors.ray_actors is the part that imports it)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from actors.spec import ActorSpec, Role
from engine.config import ConfigError

Resources = tuple[tuple[str, float], ...]  # (Ray resource name, amount), sorted by name
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every node and the GCS of a cluster on 127.0.0.1
RESERVED = ("CPU", "GPU", "memory", "object_store_memory")  # set by num_cpus / the device, not by a role's JSON


def parse_resources(text: str) -> Resources:
    """'{"decode_node": 1}' -> (("decode_node", 1.0),): a role's custom Ray resources (node labels)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"Ray resources must be a JSON object such as '{{\"decode_node\": 1}}': {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"Ray resources must be a JSON object of name: amount, got {text!r}")
    return check_resources(tuple(sorted(raw.items())))


def check_resources(resources: Resources) -> Resources:
    for name, amount in resources:
        if not isinstance(name, str) or not name or name in RESERVED:
            raise ConfigError(f"Ray resource name {name!r} is not a custom resource (CPU and GPU come from "
                              "--ray-cpus and --devices)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise ConfigError(f"Ray resource {name!r} needs a positive amount, got {amount!r}")
    return tuple((name, float(amount)) for name, amount in resources)


@dataclass(frozen=True)
class RayOptions:
    """`address`: "auto" (a running cluster), "local" (a private one started here) or HOST:PORT of its GCS.
    `num_cpus`: what each CPU actor reserves (a GPU actor reserves one GPU). The role resources go to every actor
    of that role, so that prefill lands on compute-rich nodes and decode on bandwidth-rich ones."""

    address: str = "auto"
    num_cpus: float = 1.0
    prefill_resources: Resources = ()
    decode_resources: Resources = ()
    connect_timeout: float = 20.0  # reaching the cluster
    placement_timeout: float = 60.0  # the placement group of the whole layout being placed

    def __post_init__(self) -> None:
        if not self.address or (self.address not in ("auto", "local") and ":" not in self.address):
            raise ConfigError(f"--ray takes auto, local or HOST:PORT, got {self.address!r}")
        if not 0 < self.num_cpus < math.inf:
            raise ConfigError(f"Ray CPUs per actor must be positive, got {self.num_cpus}")
        if self.connect_timeout <= 0 or self.placement_timeout <= 0:
            raise ConfigError("Ray timeouts must be positive")
        for resources in (self.prefill_resources, self.decode_resources):
            check_resources(resources)

    def environment(self) -> dict[str, str]:
        """What must be in os.environ before Ray is imported (it reads it once): a private cluster stays on
        this host's loopback. A cluster given by address is left as it is deployed."""
        return {LOOPBACK_ENV: "0"} if self.address == "local" else {}

    def demand(self, spec: ActorSpec) -> dict[str, float]:
        """What the actor of `spec` reserves on its node: a CPU share or one GPU, and its role's resources."""
        device = {"GPU": 1.0} if spec.device.startswith("cuda") else {"CPU": self.num_cpus}
        return device | dict(self.role_resources(spec.role))

    def role_resources(self, role: Role) -> Resources:
        """Draft actors are not placed on Ray (router.layout refuses them), so they have none."""
        return {Role.PREFILL: self.prefill_resources, Role.DECODE: self.decode_resources}.get(Role(role), ())


def shortfall(demands: list[dict[str, float]], available: dict[str, float]) -> str | None:
    """One sentence naming the first resource the cluster has too little of for all demands together."""
    needed: dict[str, float] = {}
    for demand in demands:
        for name, amount in demand.items():
            needed[name] = needed.get(name, 0.0) + amount
    for name, amount in sorted(needed.items()):
        have = available.get(name, 0.0)
        if have + 1e-9 < amount:
            return (f"the Ray cluster has no node with the resource {name!r}, which the layout needs {amount:g} of"
                    if have == 0 else
                    f"the Ray cluster has {have:g} of the resource {name!r} in all, and the layout needs {amount:g}")
    return None


def unfitting(demands: list[dict[str, float]], nodes: list[dict[str, float]]) -> str | None:
    """One sentence naming what no single node has enough of for one actor, when the totals suffice but no
    node can take that actor whole (nodes: each live node's total resources)."""
    for demand in demands:
        if any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in demand.items()) for node in nodes):
            continue
        short = sorted({k for node in nodes for k, v in demand.items() if node.get(k, 0.0) + 1e-9 < v})
        return (f"no node of the Ray cluster has room for an actor needing {demand}: each lacks enough of "
                f"{', '.join(repr(k) for k in short)}")
    return None
