"""The elastic layout's decisions on synthetic traffic and a fake clock: the traffic window, the layout model's
ranking, the planner switching when the mix moves and staying put under noise (margin, dwell, cooldown, cost,
a layout whose requests meet their targets), the rule that hands a lost decode role to a prefill actor, the loop
that acts on the planner's decisions, and how /metrics shows layouts."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from actors.spec import ActorSpec, Role
from actors.supervisor import ActorHandle, ActorState
from engine.config import ConfigError
from engine.core.stats import EngineStats
from router.cost_model import DecodeCost, PrefillCost
from router.degrade import lost_decode_role
from router.elastic import Elastic, LayoutClock
from router.elastic_settings import ElasticSettings
from router.layout_model import ActorCosts, Layout, Targets, candidates, predict
from router.planner import Planner, SwitchCost
from router.traffic import ClassLoad, Mix, Observed, TrafficWindow
from server.metrics import ServerMetrics

# One actor's curves: a prefill of 1000 tokens takes 0.81 s, a decode step 40 ms plus 1 ms per stream.
COSTS = ActorCosts(PrefillCost(0.01, 0.0008), DecodeCost(0.04, 0.001), 512)
SETTINGS = ElasticSettings(elastic="on", slo_ttft=1.0, slo_ttft_long=3.0, slo_itl=0.07, plan_interval=5.0,
                           window=30.0, dwell=3, cooldown=30.0, switch_seconds=2.0)
TARGETS = Targets(SETTINGS.slo_ttft, SETTINGS.slo_ttft_long, SETTINGS.slo_itl)
CHAT = ClassLoad("SISO", 3.0, 100, 100)  # many short chats
DOCUMENTS = ClassLoad("LILO", 1.0, 1000, 300)  # long prompts with long answers
COLOCATED, DISAGGREGATED = Layout(0, 2), Layout(1, 1)


def mix(*classes: ClassLoad, observed: Observed = Observed()) -> Mix:
    return Mix(classes, 30.0, 0, observed)


# ------------------------------------------------------------------------------------------ traffic window

def test_the_window_gives_each_quadrant_its_rate_and_lengths_and_forgets_old_traffic():
    window = TrafficWindow(SETTINGS, started=0.0)
    for t in range(10):
        window.arrival(float(t), prompt_tokens=100 + t, max_tokens=50)
    window.arrival(9.5, prompt_tokens=2000, max_tokens=None)  # no max_tokens: long-out
    window.arrival(9.6, prompt_tokens=10, max_tokens=20, long_prompt=True)  # the treatment says long-in
    snap = window.snapshot(10.0)
    by_quadrant = {c.quadrant: c for c in snap.classes}
    assert set(by_quadrant) == {"SISO", "LILO", "LISO"}
    assert by_quadrant["SISO"].rate == pytest.approx(10 / 10.0) and by_quadrant["SISO"].prompt_tokens == 104.5
    assert by_quadrant["LILO"].output_tokens == SETTINGS.long_output_tokens
    later = window.snapshot(36.5)  # the window is 30 s: arrivals before 6.5 s are gone
    assert {c.quadrant: c.rate for c in later.classes} == {"SISO": pytest.approx(3 / 30.0),
                                                           "LISO": pytest.approx(1 / 30.0),
                                                           "LILO": pytest.approx(1 / 30.0)}
    assert [c.quadrant for c in window.snapshot(39.55).classes] == ["LISO"]  # the 9.5 s arrival is gone too


def test_completions_are_judged_against_the_targets_of_their_quadrant():
    window = TrafficWindow(SETTINGS, started=0.0)
    window.completion(1.0, "SISO", ttft=0.5, tpot=0.05, output_tokens=40)  # within
    window.completion(2.0, "SISO", ttft=1.5, tpot=0.05, output_tokens=40)  # TTFT over 1 s
    window.completion(3.0, "LISO", ttft=1.5, tpot=None, output_tokens=1)  # long prompt: 3 s allowed
    window.completion(4.0, "LILO", ttft=0.2, tpot=0.08, output_tokens=300)  # ITL over 70 ms
    window.arrival(4.0, 100, 40)
    observed = window.snapshot(5.0).observed
    assert observed.finished == 4 and observed.attainment == 0.5
    assert observed.ttft_p50 == 0.5 and observed.tpot_p90 == 0.08
    assert {c.quadrant: c.output_tokens for c in window.snapshot(5.0).classes} == {"SISO": 40}  # what finished


# ------------------------------------------------------------------------------------------ layout model

def test_short_chats_are_served_best_colocated_and_long_prompts_with_tight_itl_disaggregated():
    chat = {str(layout): predict(layout, mix(CHAT), COSTS, TARGETS) for layout in candidates(2)}
    assert chat["0P+2D"].goodput == pytest.approx(3.0, rel=1e-3)
    assert chat["1P+1D"].goodput == 0.0  # one decode actor prefilling every chat: tokens come too slowly
    docs = {str(layout): predict(layout, mix(DOCUMENTS), COSTS, TARGETS) for layout in candidates(2)}
    assert docs["0P+2D"].goodput == 0.0  # colocated prefills stretch every stream's tokens past 70 ms
    assert 0.5 < docs["1P+1D"].goodput < 1.0
    assert [c.path for c in docs["1P+1D"].classes] == ["disaggregated"]


def test_an_overloaded_layout_serves_nothing():
    flood = ClassLoad("LISO", 5.0, 2000, 10)  # 5 x 1.6 s of prefill each second
    for layout in candidates(2):
        prediction = predict(layout, mix(flood), COSTS, TARGETS)
        assert prediction.overloaded and prediction.goodput == 0.0
        assert prediction.to_dict()["classes"][0]["ttft"] is None  # infinite: shown as null


def test_prompts_queued_now_count_against_the_layout_that_must_prefill_them():
    calm = predict(COLOCATED, mix(ClassLoad("SISO", 1.0, 400, 20)), COSTS, TARGETS)
    queued = predict(COLOCATED, Mix((ClassLoad("SISO", 1.0, 400, 20),), 30.0, 8000), COSTS, TARGETS)
    assert queued.classes[0].ttft > calm.classes[0].ttft + 1.0 and queued.goodput < calm.goodput


MERGED = Layout(0, 1, 1)  # one decode actor on both actors' cores, the other parked
LONG_PROMPTS = ClassLoad("LISO", 0.4, 2000, 20)  # documents to summarise


def test_one_decode_actor_on_every_core_is_a_candidate_only_where_cores_merge():
    assert [str(layout) for layout in candidates(2, mergeable=True)] == ["0P+2D", "1P+1D", "0P+1D*2"]
    assert MERGED not in candidates(2) and MERGED.size == 2 and MERGED.cores == 2
    for bad in ((1, 1, 1), (0, 2, 1), (0, 1, -1)):
        with pytest.raises(ValueError):
            Layout(*bad)


def test_a_merged_actor_prefills_faster_and_serves_long_prompts_the_split_layouts_cannot():
    wide = COSTS.widened(2)
    assert wide.prefill.seconds(1000) == pytest.approx(0.01 + 0.4) and wide.decode == DecodeCost(0.04, 0.0005)
    assert COSTS.widened(1) is COSTS
    by_layout = {str(layout): predict(layout, mix(LONG_PROMPTS), COSTS, TARGETS) for layout in candidates(2, True)}
    assert by_layout["1P+1D"].goodput < 0.3  # 1.6 s a prompt, 0.65 s of prefill each second on one share
    assert by_layout["0P+2D"].goodput < 0.36 < by_layout["0P+1D*2"].goodput  # the merged actor's prefill: 0.8 s


def test_the_planner_merges_for_long_prompts_and_splits_for_long_outputs_beside_chats():
    """A merged actor is the only layout that keeps up with a burst of long prompts; once the long prompts carry
    long answers beside chats, a prefill actor keeps the decode actor's steps within the ITL target."""
    sim = Simulation(DISAGGREGATED, seed=4, mergeable=True)
    sim.run(60, [LONG_PROMPTS])
    assert [(a, b) for _, a, b in sim.switches] == [(DISAGGREGATED, MERGED)]
    assert "0P+1D*2 is predicted to serve" in next(d for d in sim.decisions if d.switch).reason
    sim.run(90, [DOCUMENTS])
    assert [b for _, _, b in sim.switches] == [MERGED, DISAGGREGATED]
    sim.run(60, [DOCUMENTS])
    assert len(sim.switches) == 2  # it stays


# ------------------------------------------------------------------------------------------ planner

class Simulation:
    """Poisson traffic into a TrafficWindow on a fake clock; the planner decides every interval and the layout
    changes when it says switch."""

    def __init__(self, layout: Layout, seed: int = 0, settings: ElasticSettings = SETTINGS,
                 mergeable: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.mergeable = mergeable
        self.window = TrafficWindow(settings, started=0.0)
        self.planner = Planner(settings)
        self.layout, self.now, self.settings = layout, 0.0, settings
        self.switches: list[tuple[float, Layout, Layout]] = []
        self.decisions = []

    def run(self, seconds: float, classes: list[ClassLoad], cost: SwitchCost = SwitchCost(2.0)) -> None:
        end = self.now + seconds
        while self.now < end:
            step = self.settings.plan_interval
            for c in classes:
                for t in np.sort(self.rng.uniform(self.now, self.now + step, self.rng.poisson(c.rate * step))):
                    self.window.arrival(float(t), round(c.prompt_tokens), round(c.output_tokens),
                                        c.long_prompt)
            self.now += step
            decision = self.planner.decide(self.now, self.layout, self.window.snapshot(self.now), COSTS, cost,
                                           self.mergeable)
            self.decisions.append(decision)
            if decision.switch:
                self.switches.append((self.now, self.layout, decision.target))
                self.layout = decision.target


def test_the_planner_switches_when_the_mix_moves_and_back_when_it_moves_back():
    sim = Simulation(DISAGGREGATED, seed=1)
    sim.run(60, [CHAT])
    assert [(a, b) for _, a, b in sim.switches] == [(DISAGGREGATED, COLOCATED)]
    first = sim.switches[0][0]
    assert first >= SETTINGS.dwell * SETTINGS.plan_interval  # the better layout had to lead three decisions
    taken = next(d for d in sim.decisions if d.switch)
    assert "0P+2D is predicted to serve" in taken.reason and taken.gain > taken.cost
    assert {c["layout"] for c in taken.to_dict()["candidates"]} == {"0P+2D", "1P+1D"}
    sim.run(90, [DOCUMENTS])
    assert [(a, b) for _, a, b in sim.switches] == [(DISAGGREGATED, COLOCATED), (COLOCATED, DISAGGREGATED)]
    assert sim.switches[1][0] - first >= SETTINGS.cooldown
    sim.run(90, [CHAT])
    assert sim.switches[-1][1:] == (DISAGGREGATED, COLOCATED) and len(sim.switches) == 3


def test_the_planner_stays_put_under_noise():
    """A chat mix whose rate wanders from window to window: the colocated layout stays best throughout."""
    sim = Simulation(COLOCATED, seed=2)
    for rate in np.random.default_rng(3).uniform(1.0, 3.5, 40):
        sim.run(5, [ClassLoad("SISO", float(rate), 100, 100), ClassLoad("LISO", 0.1, 800, 20)])
    assert sim.switches == [] and len(sim.decisions) == 40
    assert all(not d.switch and d.target == COLOCATED for d in sim.decisions)


def test_a_mix_that_flips_every_decision_never_switches():
    """The best layout alternates: it never leads `dwell` decisions in a row."""
    planner = Planner(ElasticSettings(elastic="on", slo_itl=0.07, cooldown=0.0))
    chat, docs = mix(CHAT), mix(DOCUMENTS)
    decisions = [planner.decide(5.0 * i, COLOCATED, docs if i % 2 else chat, COSTS, SwitchCost(0.1))
                 for i in range(30)]
    assert not any(d.switch for d in decisions)
    assert sum("has led 1 of the 3" in d.reason for d in decisions) == 15  # each docs window: 1P+1D leads once


HALF_SERVED = Observed(finished=40, attainment=0.5)  # the colocated layout's requests, as they finished


def test_a_switch_that_does_not_pay_for_itself_is_not_taken():
    decide = Planner(SETTINGS).decide
    decisions = [decide(5.0 * i, COLOCATED, mix(DOCUMENTS, observed=HALF_SERVED), COSTS, SwitchCost(1e6))
                 for i in range(5)]
    assert not any(d.switch for d in decisions)
    assert "does not pay for the switch" in decisions[-1].reason
    cheap = Planner(SETTINGS).decide  # the same, with a switch of 2 s: taken at the third decision
    assert [cheap(5.0 * i, COLOCATED, mix(DOCUMENTS, observed=HALF_SERVED), COSTS, SwitchCost(2.0)).switch
            for i in range(1, 4)] == [False, False, True]


def test_a_layout_that_serves_its_requests_within_targets_is_left_alone():
    """The model predicts the colocated layout serves none of these requests, but its finished requests all met
    their targets: what the traffic shows wins."""
    served = Observed(finished=40, attainment=1.0)
    decide = Planner(SETTINGS).decide
    decisions = [decide(5.0 * i, COLOCATED, mix(DOCUMENTS, observed=served), COSTS, SwitchCost(1.0))
                 for i in range(6)]
    assert not any(d.switch for d in decisions)
    assert "not 15% above 0P+2D's 1 (observed: 100% within targets)" in decisions[-1].reason
    few = Observed(finished=SETTINGS.min_requests - 1, attainment=1.0)  # too few to go by: the model decides
    assert any(decide(40.0 + 5 * i, COLOCATED, mix(DOCUMENTS, observed=few), COSTS, SwitchCost(1.0)).switch
               for i in range(3))


def test_a_gain_within_the_margin_is_no_reason_to_switch():
    planner = Planner(ElasticSettings(elastic="on", slo_itl=0.07, margin=0.5, cooldown=0.0))
    decisions = [planner.decide(5.0 * i, COLOCATED, mix(DOCUMENTS, observed=HALF_SERVED), COSTS, SwitchCost(0.1))
                 for i in range(6)]
    assert not any(d.switch for d in decisions) and "not 50% above 0P+2D's 0.5" in decisions[-1].reason


# ------------------------------------------------------------------------------------------ degrading

def handle(actor_id: str, role: Role, state: ActorState, down_at: float | None = None) -> ActorHandle:
    h = ActorHandle(ActorSpec(actor_id, role), state=state, load=EngineStats())
    h.down_at = down_at
    return h


def test_the_decode_role_is_lost_when_no_decode_actor_serves_or_can():
    prefill = handle("prefill-0", Role.PREFILL, ActorState.READY)
    assert lost_decode_role([prefill, handle("decode-0", Role.DECODE, ActorState.READY)], 100.0, 5.0) is None
    restarting = handle("decode-0", Role.DECODE, ActorState.STARTING, down_at=97.0)
    assert lost_decode_role([prefill, restarting], 100.0, 5.0) is None  # down 3 s: its restart may come
    reason = lost_decode_role([prefill, restarting], 103.0, 5.0)
    assert reason == "no decode actor serves: decode-0 down 6.0s"
    crash_loop = handle("decode-1", Role.DECODE, ActorState.FAILED, down_at=99.0)
    assert lost_decode_role([prefill, crash_loop], 99.5, 5.0) == "no decode actor serves: decode-1 crash-looping"
    prefill.changing_role = Role.DECODE  # a stand-in is on its way
    assert lost_decode_role([prefill, crash_loop], 200.0, 5.0) is None
    never_up = handle("decode-2", Role.DECODE, ActorState.STARTING)  # no down_at: it never served
    assert lost_decode_role([handle("p", Role.PREFILL, ActorState.READY), never_up], 1e6, 5.0) is None


# ------------------------------------------------------------------------------------------ visibility

def test_the_layout_clock_adds_up_the_time_in_each_layout():
    clock = LayoutClock(now=0.0)
    clock.observe("1P+1D", 0.0)
    clock.observe("1P+1D", 4.0)
    clock.observe("0P+2D", 10.0)
    assert clock.totals(12.5) == {"1P+1D": 10.0, "0P+2D": 2.5}


def test_metrics_show_the_time_in_each_layout_the_switches_and_the_current_layout():
    layout = {"current": "0P+2D", "switches": 2, "seconds_in_layout": {"1P+1D": 10.0, "0P+2D": 2.5}}
    body = ServerMetrics(EngineStats, "tiny", layout=lambda: layout).render().decode()
    assert 'phase_serve:layout_seconds_total{layout="1P+1D",model_name="tiny"} 10.0' in body
    assert 'phase_serve:layout_switches_total{model_name="tiny"} 2.0' in body
    assert 'phase_serve:layout{layout="0P+2D",model_name="tiny"} 1.0' in body
    assert "layout_seconds" not in ServerMetrics(EngineStats, "tiny").render().decode()  # in process: none


@pytest.mark.parametrize("field, value", [("slo_ttft", 0.0), ("slo_itl", -1.0), ("degrade_after", -1.0),
                                          ("dwell", 0), ("window", 0.0), ("elastic", "auto")])
def test_bad_elastic_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ElasticSettings(**{field: value})


def test_a_layout_needs_a_decode_actor():
    with pytest.raises(ValueError, match="at least one decode actor"):
        Layout(2, 0)
    assert [str(x) for x in candidates(3)] == ["0P+3D", "1P+2D", "2P+1D"] and not math.isnan(Layout(1, 1).size)


# ------------------------------------------------------------------------------------------ the elastic loop

class FakeSupervisor:
    def __init__(self, handles: list[ActorHandle]) -> None:
        self.handles = handles

    def ready(self, role: Role) -> list[ActorHandle]:
        return [h for h in self.handles if h.spec.role is role and h.state is ActorState.READY]

    def by_id(self, actor_id: str) -> ActorHandle:
        return next(h for h in self.handles if h.actor_id == actor_id)


class FakeRoles:
    """RoleChanges as the loop uses it: it records the changes asked for, and makes them."""

    busy = False
    seconds_per_change = 2.0

    def __init__(self, supervisor: FakeSupervisor) -> None:
        self.supervisor = supervisor
        self.asked: list[tuple[str, Role, str]] = []

    def refusal(self, handle: ActorHandle, role: Role) -> str | None:
        return None

    async def change(self, actor_id: str, role: Role, reason: str) -> bool:
        self.asked.append((actor_id, role, reason))
        handle = self.supervisor.by_id(actor_id)
        handle.spec = replace(handle.spec, role=role)
        return True


class FakeMerges:
    """CoreMerges as the loop uses it: it records the merges and splits asked for, and parks as asked."""

    def __init__(self, supervisor: FakeSupervisor) -> None:
        self.supervisor = supervisor
        self.asked: list[tuple] = []

    async def merge(self, survivor: ActorHandle, others: list[ActorHandle], reason: str) -> bool:
        self.asked.append(("merge", survivor.actor_id, [h.actor_id for h in others]))
        for handle in others:
            handle.parked = True
        survivor.widened = (0, 1)
        return True

    async def split(self, reason: str) -> bool:
        self.asked.append(("split",))
        for handle in self.supervisor.handles:
            handle.parked, handle.widened = False, None
        return True


# Calibration points on COSTS' curves (Ready.calibration as an actor sends it)
CALIBRATION = {"prefill": [[n, COSTS.prefill.seconds(n)] for n in (100, 500, 1000)],
               "decode": [[b, COSTS.decode.step_seconds(b)] for b in (1, 4, 16)]}


def ready_actor(actor_id: str, role: Role, cpus: tuple[int, ...] = ()) -> ActorHandle:
    from transport import messages as m

    h = ActorHandle(ActorSpec(actor_id, role, cpus=cpus), ActorState.READY)
    h.ready = m.Ready(actor_id, 256, 16, {"kind": "shm"}, CALIBRATION, None, 512)
    return h


def elastic_loop(mode: str, cpus: tuple[tuple[int, ...], ...] = ((), ())) -> tuple[Elastic, FakeRoles, FakeMerges]:
    from router.placer import Placer
    from router.placement import PlacementPolicy

    settings = replace(SETTINGS, elastic=mode, dwell=1, cooldown=0.0)
    supervisor = FakeSupervisor([ready_actor("prefill-0", Role.PREFILL, cpus[0]),
                                 ready_actor("decode-0", Role.DECODE, cpus[1])])
    roles, merges, traffic = FakeRoles(supervisor), FakeMerges(supervisor), TrafficWindow(settings, started=0.0)
    loop = Elastic(supervisor, roles, merges, Placer(supervisor, {}, PlacementPolicy()), {}, traffic, settings,
                   now=0.0)
    return loop, roles, merges


async def ticks(loop: Elastic, *times: float) -> None:
    for now in times:
        loop.tick(now)
        if loop._task is not None:
            await loop._task


async def run_loop(mode: str) -> tuple[Elastic, FakeRoles]:
    loop, roles, _ = elastic_loop(mode)
    for i in range(90):  # SISO chat at 3 requests/s for 30 s
        loop.traffic.arrival(i / 3, 100, 100)
    await ticks(loop, 1.0, 30.0)
    return loop, roles


async def test_the_elastic_loop_merges_cores_for_long_prompts_and_splits_them_for_long_answers():
    loop, roles, merges = elastic_loop("on", cpus=((0,), (1,)))
    for i in range(12):  # documents: 0.4 per second for 30 s
        loop.traffic.arrival(i * 2.5, 2000, 20)
    await ticks(loop, 1.0, 30.0)
    assert merges.asked == [("merge", "decode-0", ["prefill-0"])] and roles.asked == []
    assert str(loop.last.target) == "0P+1D*2" and loop.layout() == Layout(0, 1, 1) and loop.switches == 1
    assert loop.status(30.0)["current"] == "0P+1D*2"
    for i in range(30):  # then long prompts with long answers: a merged actor's prefills stretch its streams' ITL
        loop.traffic.arrival(60 + i, 1000, 300)
    await ticks(loop, 90.0)
    assert str(loop.last.target) == "1P+1D" and merges.asked[1:] == [("split",)]
    assert roles.asked == [] and loop.layout() == Layout(1, 1) and loop.switches == 2  # prefill-0 is one already


async def test_actors_whose_cores_cannot_merge_are_never_merged():
    loop, _, merges = elastic_loop("on")  # no pinned cores: nothing to lend
    for i in range(12):
        loop.traffic.arrival(i * 2.5, 2000, 20)
    await ticks(loop, 1.0, 30.0)
    assert merges.asked == [] and "0P+1D*2" not in {c["layout"] for c in loop.last.to_dict()["candidates"]}


async def test_the_elastic_loop_changes_the_role_the_planner_asks_for():
    loop, roles = await run_loop("on")
    assert loop.costs().prefill.seconds(1000) == pytest.approx(COSTS.prefill.seconds(1000), rel=1e-3)
    assert loop.last.switch and str(loop.last.target) == "0P+2D"
    assert [(actor, role) for actor, role, _ in roles.asked] == [("prefill-0", Role.DECODE)]
    assert roles.asked[0][2].startswith("elastic: 0P+2D is predicted to serve")
    assert loop.switches == 1
    status = loop.status(30.0)
    assert status["current"] == "0P+2D" and status["decision"]["target"] == "0P+2D"
    assert status["seconds_in_layout"] == {"1P+1D": 30.0} and status["mix"]["quadrants"]["SISO"]["rate"] == 3.0


async def test_with_elastic_off_the_planner_decides_and_nothing_changes():
    loop, roles = await run_loop("off")
    assert loop.last.switch and roles.asked == [] and loop.switches == 0
