"""`serve --ray` without a cluster: its options and their checks, what each actor reserves, the node identity
that picks shared memory or the KV stream per prefill/decode pair, and that nothing imports Ray without it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from actors.ray_options import RayOptions, parse_resources, shortfall, unfitting
from actors.spec import ActorSpec
from actors.supervisor import ActorHandle
from engine.config import ConfigError
from router.handoff import export_for, shares_memory
from router.layout import ActorLayout, actor_specs
from server.settings import ActorOptions
from tests.server_utils import REPO
from transport import messages as m

SHM = {"kind": "shm", "socket": "/x/decode-0.kv.sock", "endpoint": ["10.0.0.2", 4100], "bytes_per_token": 64}


def _handle(actor_id: str, role: str, node: str, export: dict | None = None) -> ActorHandle:
    handle = ActorHandle(ActorSpec(actor_id, role))
    handle.hello = m.Hello(role, "cpu", 1, actor_id, node_id=node, node_address="10.0.0.2")
    handle.ready = m.Ready(actor_id, 64, 16, export or {"kind": "none"})
    return handle


def test_resources_parse_from_json_and_bad_ones_are_refused():
    assert parse_resources('{"decode_node": 1, "a": 0.5}') == (("a", 0.5), ("decode_node", 1.0))
    for bad in ('{"CPU": 1}', '{"x": 0}', '{"x": "1"}', '[1]', "{nope"):
        with pytest.raises(ConfigError):
            parse_resources(bad)


def test_an_address_must_be_auto_local_or_host_port():
    with pytest.raises(ConfigError, match="auto, local or HOST:PORT"):
        RayOptions("somewhere")
    with pytest.raises(ConfigError):
        ActorOptions(ray="auto", ray_decode_resources="{not json")
    assert ActorOptions(ray="local").ray_options().environment() == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    assert RayOptions("10.0.0.1:6379").environment() == {}  # a real cluster keeps its own addresses


def test_each_actor_reserves_its_device_share_and_its_role_resources():
    options = RayOptions("auto", 2.0, prefill_resources=(("compute_node", 1.0),),
                         decode_resources=(("decode_node", 1.0),))
    assert options.demand(ActorSpec("prefill-0", "prefill")) == {"CPU": 2.0, "compute_node": 1.0}
    assert options.demand(ActorSpec("decode-0", "decode", "cuda:1")) == {"GPU": 1.0, "decode_node": 1.0}


def test_ray_specs_join_over_tcp_and_keep_sharing_their_pool():
    specs = actor_specs(ActorLayout(1, 1, ray=RayOptions("auto", 2.0)), {})
    assert all(s.remote and s.ray and s.cpus == () and s.threads == 2 for s in specs)
    assert [s.share_kv for s in specs] == [False, True]
    with pytest.raises(ValueError, match="draft actors are not placed on Ray"):
        ActorLayout(0, 1, draft_actors=1, ray=RayOptions("auto"))


def test_shortfall_names_the_missing_resource():
    demands = [{"CPU": 1.0, "decode_node": 1.0}, {"CPU": 1.0}]
    assert shortfall(demands, {"CPU": 4.0, "decode_node": 1.0}) is None
    assert "no node with the resource 'decode_node'" in shortfall(demands, {"CPU": 4.0})
    assert "has 1 of the resource 'CPU' in all, and the layout needs 2" in shortfall(demands, {"CPU": 1.0,
                                                                                                "decode_node": 1.0})


def test_an_actor_no_single_node_can_hold_is_named():
    demands = [{"CPU": 2.0, "decode_node": 1.0}]
    nodes = [{"CPU": 1.0, "decode_node": 1.0}, {"CPU": 4.0}]
    assert shortfall(demands, {"CPU": 5.0, "decode_node": 1.0}) is None  # enough in all ...
    assert "each lacks enough of 'CPU', 'decode_node'" in unfitting(demands, nodes)  # ... but on no one node
    assert unfitting(demands, [*nodes, {"CPU": 2.0, "decode_node": 1.0}]) is None


def test_same_node_maps_the_pool_and_another_node_streams_to_its_endpoint():
    decode = _handle("decode-0", "decode", "node-b", SHM)
    beside, elsewhere = _handle("prefill-0", "prefill", "node-b"), _handle("prefill-1", "prefill", "node-a")
    assert shares_memory(decode, beside) and export_for(decode, beside) == SHM
    assert not shares_memory(decode, elsewhere)
    assert export_for(decode, elsewhere) == dict(SHM, kind="tcp", host="10.0.0.2", port=4100)


def test_a_pool_without_an_endpoint_on_another_node_is_relayed():
    decode = _handle("decode-0", "decode", "host:a", {"kind": "shm", "socket": "/x"})
    assert export_for(decode, _handle("prefill-0", "prefill", "host:b")) is None


@pytest.mark.process
def test_nothing_imports_ray_without_the_flag():
    code = ("import sys, cli, server.main, server.app, client, router.router, actors.supervisor, actors.worker\n"
            "cli.build_parser()\n"
            "assert 'ray' not in sys.modules, [name for name in sys.modules if name.startswith('ray.')]")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
