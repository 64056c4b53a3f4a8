"""The hand-off protocol: a request's prompt prefilled on a prefill actor straight into blocks a decode actor
reserved for it, then decoded there.

    PARKED --dispatch--> RESERVING --BlocksReserved--> PREFILLING --KVReady--> DECODING
       |                     | ReservationFailed           | prefill failed or lost
       +--colocate-----------+-----------------------------+----------------> DECODING (prefilled there)

Any phase goes back to PARKED, RESERVING or DECODING when the request is dispatched again (a retry after its
decode actor died). `Routed.move` is the one place that changes a phase, and refuses any other transition.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from actors.convert import params_to_wire, resume_to_wire
from actors.supervisor import ActorHandle
from engine.core.engine_core import EngineRequest
from router.placement import Placement
from transport import messages as m

log = logging.getLogger("router")


class Phase(StrEnum):
    PARKED = "parked"  # waiting for a decode actor to come (back) up
    RESERVING = "reserving"  # the decode actor is asked for blocks to prefill into
    PREFILLING = "prefilling"  # the prefill actor writes the prompt's KV into them
    DECODING = "decoding"  # on its decode actor (colocated requests prefill there first)


_DISPATCHED = frozenset({Phase.PARKED, Phase.RESERVING, Phase.DECODING})  # where a (re)dispatch leads
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PARKED: _DISPATCHED,
    Phase.RESERVING: _DISPATCHED | {Phase.PREFILLING},
    Phase.PREFILLING: _DISPATCHED,
    Phase.DECODING: _DISPATCHED,
}
HANDOFF_PHASES = frozenset({Phase.RESERVING, Phase.PREFILLING})  # a prefill actor holds (or will hold) it


class IllegalTransition(RuntimeError):
    """A phase change the protocol does not have (a bug in the router, never a peer's doing)."""


@dataclass(eq=False)
class Routed:
    """One request as the router tracks it, from arrival until its last sample finishes."""

    request: EngineRequest
    placement: Placement | None = None
    decode: str | None = None
    prefill: str | None = None
    phase: Phase = Phase.PARKED
    streamed: bool = False
    attempts: int = 0
    finished_samples: set[int] = field(default_factory=set)
    parked_at: float = field(default_factory=time.monotonic)
    dispatched_at: float = 0.0
    emitted: dict[int, list[int]] = field(default_factory=dict)  # sample -> the tokens forwarded to the client
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    migrations: int = 0  # times the stream moved to another decode actor
    moved_from: str | None = None  # the decode actor it is moving off, until it is placed again
    moves: tuple[str, ...] = ()  # "decode-0->decode-1", one per migration (the access line shows them)
    arrived_at: float = field(default_factory=time.monotonic)  # when the router got it
    first_token_at: float | None = None  # monotonic time its first token reached the router

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def move(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.request_id}: {self.phase} -> {phase}")
        self.phase = phase

    def awaits(self, phase: Phase, actor_id: str) -> bool:
        """In `phase` and waiting on `actor_id`: the prefill actor while prefilling, else the decode actor."""
        waiting_on = self.prefill if self.phase is Phase.PREFILLING else self.decode
        return self.phase is phase and waiting_on == actor_id


Send = Callable[[str | None, m.Message], None]
RecordEstimate = Callable[[ActorHandle, float, float, int], None]
RecordTransfer = Callable[[ActorHandle, str, int, float], None]  # (prefill actor, decode actor id, bytes, seconds)
HandleOf = Callable[[str], ActorHandle | None]


@dataclass
class TransferCounters:
    kv_bytes_transferred: int = 0
    kv_transfers: int = 0
    kv_bytes_streamed: int = 0  # page bytes sent over TCP to decode actors on other hosts (direct or relayed)


class Handoff:
    """Drives each request through the phases above, by the messages it sends and the replies it gets."""

    def __init__(self, routed: dict[str, Routed], send: Send, record_estimate: RecordEstimate,
                 handoff_timeout: float, handle_of: HandleOf = lambda actor_id: None,
                 record_transfer: RecordTransfer | None = None) -> None:
        self.routed = routed
        self.handle_of = handle_of  # the prefill actor's handle, for where it runs
        self.send, self._record_estimate, self._record_transfer = send, record_estimate, record_transfer
        self.handoff_timeout = handoff_timeout
        self.counters = TransferCounters()

    def begin(self, routed: Routed) -> None:
        """Disaggregated placement: ask the decode actor for blocks, with a deadline for the whole hand-off."""
        routed.prefill = routed.placement.prefill_actor
        routed.move(Phase.RESERVING)
        deadline = time.time() + self.handoff_timeout
        self.send(routed.decode, m.ReserveBlocks(routed.request_id, routed.request.context_token_ids, deadline))

    def colocate(self, routed: Routed) -> None:
        """Run the whole request (prefill too) on its decode actor."""
        routed.move(Phase.DECODING)
        routed.prefill = None
        req = routed.request
        self.send(routed.decode, m.AddRequest(req.request_id, req.prompt_token_ids, params_to_wire(req.params),
                                               req.priority, req.arrival_time, treatment=req.treatment,
                                               resume=resume_to_wire(req.resume)))

    def fall_back(self, routed: Routed) -> None:
        """The prefill side failed or went away: free the reservation and prefill on the decode actor."""
        self.send(routed.decode, m.ReleaseReservation(routed.request_id))
        self.colocate(routed)

    def on_reserved(self, handle: ActorHandle, msg: m.BlocksReserved) -> None:
        routed = self._held(msg.request_id, Phase.RESERVING, handle)
        if routed is None:
            self.send(handle.actor_id, m.ReleaseReservation(msg.request_id))
            return
        routed.move(Phase.PREFILLING)
        req, block_size = routed.request, handle.ready.block_size
        self.send(routed.prefill, m.PrefillRequest(req.request_id, req.context_token_ids, params_to_wire(req.params),
                                                    routed.decode, msg.block_ids, msg.num_cached_tokens // block_size,
                                                    time.time() + self.handoff_timeout,
                                                    stream=not shares_memory(handle, self.handle_of(routed.prefill)),
                                                    kv_format=handle.ready.kv_export.get("kv_format", "auto"),
                                                    num_prompt_tokens=len(req.prompt_token_ids) if req.resume else None))

    def on_reservation_failed(self, handle: ActorHandle, msg: m.ReservationFailed) -> None:
        routed = self._held(msg.request_id, Phase.RESERVING, handle)
        if routed is not None:
            log.info("reservation for %s failed (%s): colocating", msg.request_id, msg.reason,
                     extra={"request_id": msg.request_id})
            self.colocate(routed)

    def on_kv_pages(self, handle: ActorHandle, msg: m.KVPages) -> None:
        """Relay a streamed hand-off's pages to the decode actor on another host (same connection, so they
        arrive before the AddRequest that KVReady triggers)."""
        routed = self._held(msg.request_id, Phase.PREFILLING, handle)
        if routed is None:
            return
        self.counters.kv_bytes_streamed += len(msg.payload)
        self.send(routed.decode, msg)

    def on_kv_ready(self, handle: ActorHandle, msg: m.KVReady) -> None:
        routed = self._held(msg.request_id, Phase.PREFILLING, handle)
        if routed is None:
            return
        routed.move(Phase.DECODING)
        # Like for like: the placement's estimate (queue + prefill + transfer) against dispatch -> KV ready.
        if routed.placement is not None and routed.placement.disaggregated_cost is not None:
            self._record_estimate(handle, routed.placement.disaggregated_cost,
                                  time.monotonic() - routed.dispatched_at, routed.placement.uncached_tokens)
        if msg.streamed_bytes and self._record_transfer is not None:
            self._record_transfer(handle, routed.decode, msg.streamed_bytes, msg.stream_seconds)
        self.counters.kv_bytes_transferred += msg.num_bytes
        self.counters.kv_bytes_streamed += msg.streamed_bytes
        self.counters.kv_transfers += 1
        self.send(routed.decode, _commit(routed.request, msg))

    def _held(self, request_id: str, phase: Phase, handle: ActorHandle) -> Routed | None:
        routed = self.routed.get(request_id)
        return routed if routed is not None and routed.awaits(phase, handle.actor_id) else None


def _commit(req: EngineRequest, msg: m.KVReady) -> m.AddRequest:
    """Start decoding a prefilled request on the decode actor that holds its reserved blocks."""
    return m.AddRequest(req.request_id, req.prompt_token_ids, params_to_wire(req.params), req.priority,
                        req.arrival_time, prefilled=True, first_token=msg.first_token, first_logprob=msg.logprob,
                        first_top_logprobs=msg.top_logprobs, checksum=msg.checksum, treatment=req.treatment,
                        resume=resume_to_wire(req.resume))


def mappable(decode: ActorHandle) -> bool:
    """Only a pool on this host (shared memory / CUDA IPC) can be written into by our prefill actors."""
    return decode.ready.kv_export.get("kind") in ("shm", "cuda_ipc")


def attachable(decode: ActorHandle) -> bool:
    """A decode actor that prefill actors are told about: one whose pool they map, or whose KV endpoint
    (another host) they stream pages to directly."""
    return mappable(decode) or "endpoint" in decode.ready.kv_export or decode.ready.kv_export.get("kind") == "tcp"


def node_of(handle: ActorHandle | None) -> str:
    """The node an actor reported in its Hello ("" before it did)."""
    return "" if handle is None or handle.hello is None else handle.hello.node_id


def shares_memory(decode: ActorHandle, prefill: ActorHandle | None) -> bool:
    """Whether `prefill` writes into the decode actor's pool in place: a mappable pool on the same node."""
    return mappable(decode) and (prefill is None or node_of(prefill) == node_of(decode))


def export_for(decode: ActorHandle, prefill: ActorHandle) -> dict | None:
    """What `prefill` is told about the decode actor's pool: the pool itself on the same node, else its KV
    endpoint (kind "tcp"); None when it has neither for this peer (the router then relays the pages)."""
    export = decode.ready.kv_export
    if shares_memory(decode, prefill) or export.get("kind") == "tcp":
        return export
    if "endpoint" in export:
        host, port = export["endpoint"]
        return dict(export, kind="tcp", host=host, port=port)
    return None
