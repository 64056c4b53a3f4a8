"""The placement decision on fabricated calibrations: each rule of the cost model in isolation."""
from __future__ import annotations

import pytest

from actors.spec import ActorSpec
from actors.supervisor import ActorHandle
from router.cost_model import (MIN_LINK_SAMPLE_BYTES, ArrivalRate, DecodeCost, LinkEstimate, PrefillCost, Smoothed,
                               TransferCost)
from router.placer import SHM_TRANSFER, Placer, tier_tokens
from engine.kv.tier_store import NAMESPACE_BYTES, TierStore
from transport import messages as m
from router.placement import (COLOCATED, DISAGGREGATED, DecodeActorView, PlacementPolicy, PrefillActorView,
                              place)

PREFILL = PrefillCost(fixed=0.005, per_token=0.0005)  # 2k tokens/s
DECODE = DecodeCost(fixed=0.02, per_seq=0.001)
FAST_LINK = TransferCost(latency=0.0005, bytes_per_second=10e9)
KV_BYTES = 23_040  # SmolLM2 bf16: 30 layers * 2 * 3 heads * 64 * 2 bytes
AUTO = PlacementPolicy("auto")


def decode_actor(actor_id="d0", running=0, cached=0, free_blocks=1000) -> DecodeActorView:
    return DecodeActorView(actor_id, running, free_blocks, cached, PREFILL, DECODE)


def prefill_actor(link=FAST_LINK, queued=0) -> PrefillActorView:
    return PrefillActorView("p0", PREFILL, queued, link)


def test_long_prompt_while_decode_streams_run_is_disaggregated():
    p = place(AUTO, 2000, 16, [decode_actor(running=32)], [prefill_actor()], KV_BYTES)
    assert p.path == DISAGGREGATED and p.prefill_actor == "p0"
    assert p.disaggregated_cost < p.colocated_cost


def test_short_prompt_whose_stall_fits_the_itl_slack_colocates_while_streams_run():
    # 64 tokens: 37 ms of prefill, within the 100 ms slack: the 32 streams lose no inter-token budget.
    p = place(AUTO, 64, 16, [decode_actor(running=32)], [prefill_actor()], KV_BYTES)
    assert p.path == COLOCATED
    no_slack = place(PlacementPolicy("auto", itl_slack=0.0), 64, 16, [decode_actor(running=32)], [prefill_actor()],
                     KV_BYTES)
    assert no_slack.path == DISAGGREGATED  # every millisecond of stall counted: the prefill actor wins


def test_prompts_queued_on_the_decode_actor_count_towards_colocated_ttft():
    idle = place(AUTO, 256, 16, [decode_actor(running=0)], [prefill_actor()], KV_BYTES)
    backlog = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, queued_prefill_tokens=8000)
    busy = place(AUTO, 256, 16, [backlog], [prefill_actor()], KV_BYTES)
    assert idle.path == COLOCATED and busy.path == DISAGGREGATED
    assert busy.estimated_ttft < busy.colocated_cost


def test_streams_expected_to_arrive_during_a_long_prefill_count_as_stalled():
    idle_now = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, arrival_rate=2.0)  # 2 req/s keep coming
    p = place(AUTO, 2000, 16, [idle_now], [prefill_actor()], KV_BYTES)
    assert p.path == DISAGGREGATED
    quiet = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, arrival_rate=0.0)
    assert place(AUTO, 2000, 16, [quiet], [prefill_actor()], KV_BYTES).path == COLOCATED


def test_arrival_rate_is_the_inverse_of_the_smoothed_gap():
    rate = ArrivalRate()
    assert rate.rate == 0.0
    for t in range(11):
        rate = rate.observe(t * 0.5)  # one arrival every 0.5 s
    assert rate.rate == pytest.approx(2.0)
    rate = rate.observe(5.0 + 10.0)  # a 10 s pause pulls the rate down, smoothly
    assert 0.5 < rate.rate < 2.0


def test_idle_decode_actor_colocates():
    p = place(AUTO, 2000, 16, [decode_actor(running=0)], [prefill_actor()], KV_BYTES)
    assert p.path == COLOCATED and p.prefill_actor is None


def test_transfer_slower_than_prefill_colocates():
    slow_link = TransferCost(latency=0.01, bytes_per_second=1e6)  # 1 MB/s: 46 s for 2000 tokens of KV
    p = place(AUTO, 2000, 16, [decode_actor(running=32)], [prefill_actor(slow_link)], KV_BYTES)
    assert p.path == COLOCATED
    assert p.disaggregated_cost > p.colocated_cost


def test_busy_prefill_queue_colocates_short_prompt():
    p = place(AUTO, 64, 16, [decode_actor(running=2)], [prefill_actor(queued=20_000)], KV_BYTES)
    assert p.path == COLOCATED


def test_cached_prefix_picks_that_actor_and_only_the_tail_counts():
    actors = [decode_actor("d0", running=1), decode_actor("d1", running=5, cached=1984)]
    p = place(AUTO, 2000, 16, actors, [prefill_actor()], KV_BYTES)
    assert p.decode_actor == "d1"
    assert p.uncached_tokens == 16


def test_least_loaded_actor_without_cache():
    actors = [decode_actor("d0", running=9), decode_actor("d1", running=3)]
    assert place(AUTO, 100, 16, actors, [], KV_BYTES).decode_actor == "d1"


def test_no_actor_can_fit_returns_none():
    assert place(AUTO, 4000, 16, [decode_actor(free_blocks=10)], [prefill_actor()], KV_BYTES) is None


@pytest.mark.parametrize("mode,expected", [("always", DISAGGREGATED), ("never", COLOCATED)])
def test_fixed_policies_override_the_cost_model(mode, expected):
    running = 0 if mode == "always" else 64  # the opposite of what auto would pick
    p = place(PlacementPolicy(mode), 2000, 16, [decode_actor(running=running)], [prefill_actor()], KV_BYTES)
    assert p.path == expected


def test_without_prefill_actors_everything_colocates():
    p = place(PlacementPolicy("always"), 2000, 16, [decode_actor(running=64)], [], KV_BYTES)
    assert p.path == COLOCATED and p.disaggregated_cost is None


def test_header_names_decision_and_estimates():
    header = place(AUTO, 2000, 16, [decode_actor(running=32)], [prefill_actor()], KV_BYTES).header()
    assert header.startswith("disaggregated;") and "colocated=" in header and "uncached=2000" in header


def test_prefill_cost_fit_recovers_a_quadratic():
    truth = PrefillCost(0.01, 0.0004, 1e-8)
    fitted = PrefillCost.fit([(n, truth.seconds(n)) for n in (32, 128, 512, 1024, 2048)])
    for n in (64, 700, 3000):
        assert fitted.seconds(n) == pytest.approx(truth.seconds(n), rel=1e-6)


def test_decode_cost_fit_is_linear_in_batch():
    fitted = DecodeCost.fit([(1, 0.021), (8, 0.028), (32, 0.052)])
    assert fitted.per_seq == pytest.approx(0.001, rel=1e-6) and fitted.fixed == pytest.approx(0.02, rel=1e-6)


def test_smoothing_moves_towards_observations_and_clips_outliers():
    s = Smoothed()
    for _ in range(50):
        s = s.observe(predicted=1.0, observed=2.0)
    assert s.ratio == pytest.approx(2.0, rel=0.02)
    assert Smoothed().observe(1.0, 1000.0).ratio == pytest.approx(0.9 + 0.1 * 10.0)


def test_invalid_mode_is_rejected():
    with pytest.raises(ValueError, match="auto, always or never"):
        PlacementPolicy("sometimes")


def test_link_estimate_learns_bandwidth_from_large_transfers_only():
    prior = TransferCost(latency=0.005, bytes_per_second=2.5e8)
    est = LinkEstimate(prior)
    assert est.cost == prior
    assert est.observe(MIN_LINK_SAMPLE_BYTES - 1, 10.0) == est  # latency-bound: no bandwidth sample
    for _ in range(40):  # 8 MiB in 0.805 s: 10 MiB/s once the latency is taken off
        est = est.observe(8 << 20, 0.805)
    assert est.samples == 40
    assert est.cost.bytes_per_second == pytest.approx(10 << 20, rel=1e-6)
    assert est.cost.latency == prior.latency


def test_a_link_measured_slow_stops_disaggregating_over_it():
    est = LinkEstimate(TransferCost(latency=0.005, bytes_per_second=2.5e8))
    before = place(AUTO, 2000, 16, [decode_actor(running=32)], [prefill_actor(est.cost)], KV_BYTES)
    assert before.path == DISAGGREGATED
    for _ in range(30):  # the streams on this link run at 1 MB/s
        est = est.observe(KV_BYTES * 2000, 0.005 + KV_BYTES * 2000 / 1e6)
    after = place(AUTO, 2000, 16, [decode_actor(running=32)], [prefill_actor(est.cost)], KV_BYTES)
    assert after.path == COLOCATED and after.disaggregated_cost > before.disaggregated_cost * 10


class _Supervisor:
    def __init__(self, handles):
        self.handles = handles

    def by_id(self, actor_id):
        for handle in self.handles:
            if handle.actor_id == actor_id:
                return handle
        raise KeyError(actor_id)


def _handle(actor_id, role, kind, node):
    handle = ActorHandle(ActorSpec(actor_id, role, remote=node != "a"))
    handle.hello = m.Hello(role, "cpu", 1, actor_id, node_id=node)
    handle.ready = m.Ready(actor_id, 100, 16, {"kind": kind})
    return handle


def test_placer_keeps_one_estimate_per_node_pair_and_shared_pools_cost_nothing():
    prefill = _handle("prefill-0", "prefill", "none", "a")
    far, near = _handle("decode-r", "decode", "tcp", "b"), _handle("decode-0", "decode", "shm", "a")
    far_too = _handle("decode-s", "decode", "tcp", "b")
    placer = Placer(_Supervisor([prefill, far, far_too, near]), {}, AUTO)
    placer.record_transfer(prefill, "decode-r", 4 << 20, 2.005)  # 2 MiB/s
    placer.record_transfer(prefill, "decode-gone", 4 << 20, 1.0)  # an actor no longer known: ignored
    assert placer.transfer_cost(prefill, far).bytes_per_second == pytest.approx(2 << 20, rel=0.01)
    assert placer.transfer_cost(prefill, far_too) == placer.transfer_cost(prefill, far)  # the same two nodes
    assert placer.transfer_cost(prefill, near) is SHM_TRANSFER
    assert list(placer.link_costs()) == ["a->b"]


def test_a_short_prompt_behind_a_long_prefill_waits_one_step_not_the_whole_prefill():
    """With stall-free shares the engine starts a short prompt beside a running long prefill: the colocated TTFT
    counts the step in progress and its own step, not the 8000 queued tokens."""
    backlog = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, queued_prefill_tokens=8000, step_tokens=512)
    short = place(AUTO, 64, 16, [backlog], [], KV_BYTES, short=True)
    assert short.path == COLOCATED
    assert short.estimated_ttft == pytest.approx(PREFILL.seconds(512) + PREFILL.seconds(512))
    as_long = place(AUTO, 64, 16, [backlog], [], KV_BYTES, short=False)
    assert as_long.estimated_ttft == pytest.approx(PREFILL.seconds(8064))
    unknown_budget = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, queued_prefill_tokens=8000)
    assert place(AUTO, 64, 16, [unknown_budget], [], KV_BYTES, short=True).estimated_ttft == as_long.estimated_ttft


def test_a_short_prompt_goes_to_an_idle_prefill_actor_when_that_is_sooner_than_the_busy_decode_actor():
    backlog = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, queued_prefill_tokens=8000, step_tokens=512)
    p = place(AUTO, 64, 16, [backlog], [prefill_actor()], KV_BYTES, short=True)
    assert p.path == DISAGGREGATED and p.estimated_ttft < PREFILL.seconds(512)


def test_a_short_prompt_on_an_idle_actor_costs_its_own_prefill():
    idle = DecodeActorView("d0", 0, 1000, 0, PREFILL, DECODE, step_tokens=512)
    p = place(AUTO, 64, 16, [idle], [prefill_actor()], KV_BYTES, short=True)
    assert p.estimated_ttft == pytest.approx(PREFILL.seconds(64))


@pytest.mark.parametrize("long_prompt, prompt, step, short", [
    (None, 100, 512, True), (None, 600, 512, False), (None, 100, 0, False),  # by length, as the engine judges
    (True, 100, 512, False), (False, 6000, 512, True),  # the request's quadrant wins
])
def test_the_router_judges_short_as_the_engine_does(long_prompt, prompt, step, short):
    from engine.core.engine_core import EngineRequest
    from engine.core.treatment import Treatment
    from engine.sampling.sampling_params import SamplingParams
    from router.placer import _is_short

    request = EngineRequest("r", [1] * prompt, SamplingParams(), treatment=Treatment(long_prompt=long_prompt))
    assert _is_short(request, prompt, step) is short


def test_prompt_tokens_the_kv_tiers_hold_count_as_loaded_when_colocated(tmp_path):
    busy = dict(running=32)
    computed = place(AUTO, 2000, 16, [decode_actor(**busy)], [prefill_actor()], KV_BYTES)
    held = DecodeActorView("d0", 32, 1000, 0, PREFILL, DECODE, loadable_prompt_tokens=1984)
    loaded = place(AUTO, 2000, 16, [held], [prefill_actor()], KV_BYTES)
    assert computed.path == DISAGGREGATED and loaded.path == COLOCATED  # 16 tokens to compute: no stall worth a move
    assert loaded.uncached_tokens == 16 and loaded.estimated_ttft == pytest.approx(PREFILL.seconds(16))
    namespace = bytes(NAMESPACE_BYTES)
    store = TierStore("host", tmp_path, 1 << 20, namespace, lambda: 0)
    for depth, block_hash in enumerate([11, 12, 13]):
        store.write(block_hash, depth, b"pages")
    export = {"kv_tiers": {"namespace": namespace.hex(), "block_size": 16, "dirs": [str(tmp_path)]}}
    assert tier_tokens(export, [11, 12, 99, 13]) == 32  # the leading run the tiers hold
    assert tier_tokens({}, [11, 12]) == 0 and tier_tokens(export, []) == 0
