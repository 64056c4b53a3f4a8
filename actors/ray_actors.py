"""The actors on a Ray cluster (`serve --ray`): Ray places, starts and watches them, and that is all it does.

Each Ray actor runs the same actor code as `cli.py worker --connect` (actors.worker.run_actor) and joins the
server's supervisor over this project's authenticated TCP transport; KV pages go by shared memory to peers on
its node and over the direct KV stream to the others. Ray is on no data path. The whole layout is one placement
group, so it is placed whole or not at all; a replacement actor goes into its predecessor's bundle, which Ray
moves to another node when its node is lost. Only this module imports Ray, and only `--ray` imports it.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.ray_options import RayOptions, shortfall, unfitting
from actors.spec import NODE_ADDRESS_ENV, NODE_ID_ENV, ActorSpec, socket_name
from engine.disk_cache import ROOT_ENV
from transport.auth import SECRET_ENV
from transport.owned import owned_entries, owned_prefix, reclaim

RAY_DIR_KIND = "ray"  # transport.owned: an actor's private socket directory on its node
RECLAIM_SECONDS = 5.0  # how long this node's actors get to exit when the server leaves the cluster
PROBE_SECONDS = 5.0  # how long a GCS address gets to accept a TCP connection before it counts as not answering


class RayUnavailable(RuntimeError):
    """The cluster cannot be reached, or cannot place the layout; the message is one sentence for the user."""


class ActorProcess:
    """The Ray actor: one of our actors in a Ray worker process (the class Ray instantiates on its node)."""

    def run(self, spec_json: str, host: str, port: int, secret: bytes) -> int:
        """Serve as the spec's actor until the server shuts it down; returns its exit status."""
        from actors import worker

        context = ray.get_runtime_context()
        os.environ[NODE_ID_ENV] = context.get_node_id()
        os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()
        os.environ[SECRET_ENV] = secret.decode()  # a prefill actor's KV streams authenticate with it too
        spec = _on_this_node(ActorSpec.from_json(spec_json))
        try:
            return worker.run_actor(spec, (host, port, secret))
        finally:
            shutil.rmtree(Path(spec.socket_path).parent, ignore_errors=True)


def _on_this_node(spec: ActorSpec) -> ActorSpec:
    """The spec with its socket (beside which a decode actor serves its pool's descriptor) in a private
    directory of this node: the server's directory is on another machine. The directory is named for this
    process (transport.owned), so the next actor started on the node removes it if this one is killed."""
    tmp = Path(tempfile.gettempdir())
    reclaim(tmp, RAY_DIR_KIND)
    directory = tempfile.mkdtemp(prefix=f"{owned_prefix(RAY_DIR_KIND)}{spec.actor_id}-", dir=tmp)
    return replace(spec, socket_path=str(Path(directory) / socket_name(spec.actor_id)))


@dataclass
class Launched:
    """A Ray actor and the reference its run() resolves to: an exit status, or RayActorError when it dies."""

    actor: ray.actor.ActorHandle
    done: ray.ObjectRef

    def finished(self) -> asyncio.Future:
        return asyncio.wrap_future(self.done.future())


class RayCluster:
    """The connection to the cluster and the placement group that holds the layout."""

    def __init__(self, options: RayOptions, specs: list[ActorSpec]) -> None:
        self.options = options
        self.bundles = {spec.actor_id: i for i, spec in enumerate(specs)}
        self.demands = [options.demand(spec) for spec in specs]
        self.group: PlacementGroup | None = None

    async def open(self) -> None:
        """Connect, check the demands against the cluster, and wait until the placement group is placed."""
        connect(self.options)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        missing = shortfall(self.demands, ray.cluster_resources()) or unfitting(self.demands, nodes)
        if missing:
            raise RayUnavailable(f"cannot place the actors: {missing}")
        self.group = placement_group(self.demands, strategy="PACK")
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.group.ready().future()), self.options.placement_timeout)
        except asyncio.TimeoutError:
            raise RayUnavailable(f"cannot place the actors: the Ray cluster did not place {self.demands} within "
                                 f"{self.options.placement_timeout:g}s (the nodes with room are busy)") from None

    def server_host(self) -> str:
        """The address Ray actors reach this process on: its Ray node's address (127.0.0.1 on loopback)."""
        return ray.util.get_node_ip_address()

    def launch(self, spec: ActorSpec, address: tuple[str, int], secret: bytes) -> Launched:
        """Start the spec's actor in its bundle of the placement group."""
        demand = self.demands[self.bundles[spec.actor_id]]
        custom = {k: v for k, v in demand.items() if k not in ("CPU", "GPU")}
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundles[spec.actor_id])
        actor = ray.remote(ActorProcess).options(
            num_cpus=demand.get("CPU", 0), num_gpus=demand.get("GPU", 0), resources=custom,
            scheduling_strategy=strategy, max_restarts=0, runtime_env={"env_vars": _actor_environment(spec)}).remote()
        return Launched(actor, actor.run.remote(spec.to_json(), address[0], address[1], secret))

    def kill(self, launched: Launched) -> None:
        try:
            ray.kill(launched.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or the cluster is: either way it no longer runs
            pass

    def close(self) -> None:
        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster went first
                pass
        ray.shutdown()
        _reclaim_when_gone(Path(tempfile.gettempdir()))


def _reclaim_when_gone(tmp: Path, seconds: float = RECLAIM_SECONDS) -> None:
    """Remove the socket directories that this node's Ray actors left: ray.kill, a lost node and the end of the
    job end a worker with SIGKILL, so its own cleanup never runs. Ray ends the job's actors a moment after
    shutdown returns; wait that long, and leave whatever a live process (another server's actor) still owns.
    The directories on other nodes go when the next actor starts there (_on_this_node)."""
    deadline = time.monotonic() + seconds
    while True:
        reclaim(tmp, RAY_DIR_KIND)
        if not owned_entries(tmp, RAY_DIR_KIND) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def connect(options: RayOptions) -> None:
    """ray.init for `--ray auto | local | HOST:PORT`; a GCS that does not answer is an error at once."""
    if options.address == "local":  # on loopback: RayOptions.environment() was applied before Ray's import
        ray.init(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, 1), log_to_driver=True,
                 runtime_env={"env_vars": _search_path()})
        return
    if options.address != "auto":
        probe(options.address)
    init = threading.Thread(target=_init, args=(options.address, failure := []), daemon=True, name="ray-init")
    init.start()
    init.join(options.connect_timeout)
    if init.is_alive():  # accepted TCP but never answered as a GCS; the thread dies with this process
        raise RayUnavailable(f"cannot reach the Ray cluster at {options.address}: no answer within "
                             f"{options.connect_timeout:g}s")
    if failure:
        raise RayUnavailable(f"cannot reach the Ray cluster at {options.address}: {failure[0]}")


def _init(address: str, failure: list[str]) -> None:
    """ray.init, which may wait for minutes on an address that does not speak Ray; the caller bounds it."""
    try:
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": _search_path()})
    except Exception as exc:  # noqa: BLE001 - reported to the user as why the cluster cannot be reached
        failure.append(str(exc) or type(exc).__name__)


def probe(address: str) -> None:
    """RayUnavailable unless something accepts TCP connections at HOST:PORT (ray.init itself retries a GCS
    that is not there for minutes)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except (OSError, ValueError) as exc:
        raise RayUnavailable(f"cannot reach the Ray cluster at {address}: {exc or type(exc).__name__}") from None


def _search_path() -> dict[str, str]:
    """The project's root first on the Ray workers' path, so that they run this checkout's code."""
    root = str(Path(__file__).resolve().parent.parent)
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}


FORWARDED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PHASE_SERVE_LOG_FORMAT", "PHASE_SERVE_LOG_LEVEL", ROOT_ENV)


def _actor_environment(spec: ActorSpec) -> dict[str, str]:
    """What a local actor would inherit and the Ray actor must be given: its torch thread counts, the server's
    log settings, actor knobs and cache root, and the search path. Ray narrows CUDA_VISIBLE_DEVICES to the GPU it
    reserved itself; the secret goes as an argument of run(), not into the job's visible environment."""
    env = spec.child_environment()
    return {k: env[k] for k in FORWARDED if k in env} | _search_path()
