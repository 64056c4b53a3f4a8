"""The elastic layout in the running router: every `plan_interval` seconds the planner (router/planner.py) is
shown the live mix (router/traffic.py), the actors' measured costs and what a role change costs, and decides;
with `--elastic on` a decision to switch changes actors' roles (router/roles.py), or merges every actor's cores
into one decode actor and splits them again (router/merges.py). With it off, the decisions are still made and
shown in /status, and nothing changes.

The layout is the count of ready prefill and decode actors among those that may change role (local actors and
Ray actors; not workers that joined from another host, nor draft actors), and of those parked with their cores
lent to a merged decode actor. `LayoutClock` keeps the time spent in each layout for /metrics.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Mapping

from actors.spec import Role
from actors.supervisor import ActorHandle, ActorState, Supervisor
from router.cost_model import DecodeCost, PrefillCost
from router.elastic_settings import ElasticSettings
from router.handoff import HANDOFF_PHASES, Phase, Routed
from router.layout_model import ActorCosts, Layout
from router.merges import CoreMerges, mergeable
from router.placer import DEFAULT_DECODE, Placer, decode_cost
from router.planner import Decision, Planner, SwitchCost
from router.roles import RoleChanges
from router.traffic import TrafficWindow

log = logging.getLogger("router")


class LayoutClock:
    """Seconds spent in each layout ("none": no decode actor served)."""

    def __init__(self, now: float) -> None:
        self.seconds: dict[str, float] = {}
        self.layout: str | None = None
        self.since = now

    def observe(self, layout: str, now: float) -> None:
        """The layout is `layout` at `now`: the time since the last observation was the previous one's (the time
        before the first, the first one's)."""
        previous = self.layout or layout
        self.seconds[previous] = self.seconds.get(previous, 0.0) + max(0.0, now - self.since)
        self.layout, self.since = layout, now

    def totals(self, now: float) -> dict[str, float]:
        totals = dict(self.seconds)
        if self.layout is not None:
            totals[self.layout] = totals.get(self.layout, 0.0) + max(0.0, now - self.since)
        return totals


class Elastic:
    def __init__(self, supervisor: Supervisor, roles: RoleChanges, merges: CoreMerges, placer: Placer,
                 routed: Mapping[str, Routed], traffic: TrafficWindow, settings: ElasticSettings, now: float) -> None:
        self.supervisor, self.roles, self.merges, self.placer, self.routed = supervisor, roles, merges, placer, routed
        self.traffic, self.settings = traffic, settings
        self.planner = Planner(settings)
        self.clock = LayoutClock(now)
        self.last: Decision | None = None
        self.switches = 0
        self._next = now + settings.plan_interval
        self._task: asyncio.Task | None = None

    def switchable(self) -> list[ActorHandle]:
        return [h for h in self.supervisor.handles if h.spec.role in (Role.PREFILL, Role.DECODE)
                and (h.spec.ray or not h.spec.remote) and h.state is ActorState.READY]

    def layout(self) -> Layout | None:
        """The live layout, None while no decode actor serves."""
        actors = self.switchable()
        roles = [h.changing_role or h.spec.role for h in actors if not h.parked]
        decodes = roles.count(Role.DECODE)
        lent = sum(h.parked for h in actors)
        if not decodes or (lent and (decodes > 1 or Role.PREFILL in roles)):
            return None
        return Layout(roles.count(Role.PREFILL), decodes, lent)

    def tick(self, now: float, decide: bool = True) -> None:
        """From the router's upkeep loop: account the time, and decide when a decision is due (`decide=False`: a
        role change just ended, only the clock turns)."""
        layout = self.layout()
        self.clock.observe(str(layout) if layout else "none", now)
        if not decide or now < self._next:
            return
        self._next = now + self.settings.plan_interval
        if layout is None or layout.size < 2 or self.roles.busy or (self._task and not self._task.done()):
            return
        mix = self.traffic.snapshot(now, self._queued_prompt_tokens())
        decision = self.planner.decide(now, layout, mix, self.costs(), self._switch_cost(),
                                       mergeable(self.switchable()))
        self.last = decision
        if not decision.switch:
            return
        if not self.settings.on:
            log.info("elastic off: the planner would switch %s -> %s: %s", decision.current, decision.target,
                     decision.reason)
            return
        log.info("switching layout %s -> %s: %s", decision.current, decision.target, decision.reason,
                 extra={"layout": str(decision.target), "reason": decision.reason})
        self._task = asyncio.ensure_future(self._apply(decision))

    async def _apply(self, decision: Decision) -> None:
        reason, target = f"elastic: {decision.reason}", decision.target
        if target.lent:
            survivor = self._survivor()
            others = [h for h in self.switchable() if h is not survivor]
            done = survivor is not None and await self.merges.merge(survivor, others, reason)
        else:
            done = (not decision.current.lent or await self.merges.split(reason)) \
                and await self._change_roles(target, reason)
        if done:
            self.switches += 1

    async def _change_roles(self, target: Layout, reason: str) -> bool:
        """Role changes, one actor at a time, until the layout is `target`; False when one failed or was refused."""
        for _ in range(len(self.switchable())):
            current = self.layout()
            if current == target:
                return True
            picked = None if current is None else self._pick(current, target)
            if picked is None:
                return False
            handle, role = picked
            try:
                if not await self.roles.change(handle.actor_id, role, reason) or self.layout() == current:
                    return False
            except ValueError as exc:
                log.info("no switch after all: %s", exc)
                return False
        return self.layout() == target

    def _survivor(self) -> ActorHandle | None:
        """The decode actor that takes every core in a merge: the one holding the most (its streams stay)."""
        decodes = self.supervisor.ready(Role.DECODE)
        return max(decodes, key=lambda h: self._held_tokens(h.actor_id), default=None)

    def _pick(self, current: Layout, target: Layout) -> tuple[ActorHandle, Role] | None:
        """The actor that changes: the decode actor holding the fewest streams, or the prefill actor with the
        least queued."""
        role_from, role_to = (Role.DECODE, Role.PREFILL) if target.prefill > current.prefill else \
            (Role.PREFILL, Role.DECODE)
        handles = [h for h in self.supervisor.ready(role_from) if self.roles.refusal(h, role_to) is None]
        if not handles:
            return None
        return min(handles, key=lambda h: self._held_tokens(h.actor_id)), role_to

    def costs(self) -> ActorCosts:
        """The switchable actors' curves, averaged (they share the machine and a core count)."""
        actors = self.switchable()
        prefills = [self.placer.prefill_cost(h) for h in actors]
        decodes = [decode_cost(h) for h in actors if (h.ready.calibration or {}).get("decode")]
        steps = [h.ready.step_tokens for h in actors if h.ready.step_tokens]
        prefill = PrefillCost(*(sum(getattr(c, f) for c in prefills) / len(prefills)
                                for f in ("fixed", "per_token", "per_token_sq")))
        decode = DecodeCost(sum(c.fixed for c in decodes) / len(decodes),
                            sum(c.per_seq for c in decodes) / len(decodes)) if decodes else DEFAULT_DECODE
        return ActorCosts(prefill, decode, steps[0] if steps else ActorCosts.step_tokens)

    def _switch_cost(self) -> SwitchCost:
        """The change's own time (as measured so far), and the prefill of the context the cheapest actor to move
        holds (its streams are resumed elsewhere)."""
        held = min((self._held_tokens(h.actor_id) for h in self.switchable()), default=0)
        return SwitchCost(self.roles.seconds_per_change, self.costs().prefill.seconds(held))

    def _held_tokens(self, actor_id: str) -> int:
        return sum(r.request.num_context_tokens + sum(map(len, r.emitted.values())) for r in self.routed.values()
                   if r.decode == actor_id or (r.prefill == actor_id and r.phase in HANDOFF_PHASES))

    def _queued_prompt_tokens(self) -> int:
        """Prompt tokens of requests not prefilled yet: parked, handed off, or queued on a decode actor."""
        return sum(r.request.num_context_tokens for r in self.routed.values()
                   if r.phase is not Phase.DECODING or not r.streamed)

    def status(self, now: float) -> dict:
        layout = self.layout()
        return {"elastic": self.settings.elastic, "current": str(layout) if layout else "none",
                "targets": {"ttft": self.settings.slo_ttft, "ttft_long": self.settings.slo_ttft_long,
                            "itl": self.settings.slo_itl},
                "switches": self.switches,
                "seconds_in_layout": {k: round(v, 3) for k, v in self.clock.totals(now).items()},
                "mix": self.traffic.snapshot(now, self._queued_prompt_tokens()).to_dict(),
                "decision": self.last.to_dict() if self.last else None}
