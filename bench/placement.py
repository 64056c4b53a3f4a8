"""Placement policies side by side, in one run: start one server per policy, run the same workload against
each in turn (bench/workloads.py --compare), stop them.

    python -m bench.placement [--policies colocated-2core,never,always,auto] [workloads options...]
    python -m bench.placement --policies always,ray-apart,ray-together [workloads options...]

Servers (SmolLM2 by default, bf16): `colocated-2core` is one decode actor on every core, no prefill actor;
`never`, `always` and `auto` are one prefill + one decode actor with one core each and that --disagg mode.
`ray-apart` and `ray-together` are `always` on a Ray cluster on this host's loopback (bench.ray_nodes: nodes A
and B), the prefill actor on A and the decode actor on B (KV over the direct TCP stream) or both on A (shared
memory); the cluster is started for them and stopped at the end.
Anything after the options below goes to bench/workloads.py unchanged (defaults: the chat+liso-bursts mix at
0.5 and 1 request/s for 60 s each, long prompts up to 1024 tokens, outputs up to 256; results, summary and
plots under bench/results/ with the name 'placement').
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from bench import workloads
from bench.provenance import provenance

SERVER_FLAGS = {
    "colocated-2core": ["--decode-actors", "1", "--prefill-actors", "0"],
    "never": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "never"],
    "always": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "always"],
    "auto": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "auto"],
    "ray-apart": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "always",
                  "--ray-prefill-resources", '{"node_a": 1}', "--ray-decode-resources", '{"node_b": 1}'],
    "ray-together": ["--decode-actors", "1", "--prefill-actors", "1", "--disagg", "always",
                     "--ray-prefill-resources", '{"node_a": 1}', "--ray-decode-resources", '{"node_a": 1}'],
}
DEFAULT_WORKLOAD = ["--mix", "chat+liso-bursts", "--rates", "0.5,1", "--duration", "60", "--burst-every", "10",
                    "--burst-size", "2", "--max-long-in", "1024", "--max-long-out", "256", "--name", "placement"]


def start_server(policy: str, port: int, extra: Sequence[str], ray_address: str | None) -> subprocess.Popen:
    on_ray = ["--ray", ray_address] if policy.startswith("ray-") else []
    cmd = [sys.executable, "cli.py", "serve", "--port", str(port), "--log-level", "warning",
           *SERVER_FLAGS[policy], *on_ray, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=dict(os.environ))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} did not become healthy in {timeout:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", default="colocated-2core,never,always,auto")
    p.add_argument("--base-port", type=int, default=8201)
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. '--dtype bfloat16'")
    args, workload_args = p.parse_known_args(argv)
    started = provenance("placement", argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in SERVER_FLAGS]
    if unknown:
        p.error(f"unknown policies {unknown}; choose from {', '.join(SERVER_FLAGS)}")
    urls = {name: f"http://127.0.0.1:{args.base_port + i}" for i, name in enumerate(policies)}
    procs: dict[str, subprocess.Popen] = {}
    cluster = _ray_cluster() if any(name.startswith("ray-") for name in policies) else None
    try:
        for i, (name, url) in enumerate(urls.items()):  # one at a time: each calibrates on a quiet machine
            print(f"starting {name} at {url} ...", flush=True)
            procs[name] = start_server(name, args.base_port + i, args.server_args.split(),
                                       cluster.address if cluster else None)
            wait_healthy(url, procs[name])
        compare = ",".join(f"{name}={url}" for name, url in urls.items())
        origin = {**started, "policies": {name: SERVER_FLAGS[name] for name in policies},
                  "server_args": args.server_args}
        return workloads.main([*DEFAULT_WORKLOAD, *workload_args, "--compare", compare], origin)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if cluster is not None:
            cluster.shutdown()


def _ray_cluster():
    from bench.ray_nodes import start_cluster

    return start_cluster()


if __name__ == "__main__":
    sys.exit(main())
