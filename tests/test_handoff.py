"""The router's parts without processes: the hand-off state machine, its messages, and parking (fake clock)."""
import pytest

from actors.spec import ActorSpec
from actors.supervisor import ActorHandle
from engine.core.engine_core import EngineRequest
from engine.sampling.sampling_params import SamplingParams
from engine.core.client_protocol import RequestFailedError
from router.failover import Failover
from router.handoff import TRANSITIONS, Handoff, IllegalTransition, Phase, Routed
from router.placement import DISAGGREGATED, Placement
from transport import messages as m


def _handle(actor_id: str, role: str, kind: str = "shm") -> ActorHandle:
    handle = ActorHandle(ActorSpec(actor_id, role))
    handle.ready = m.Ready(actor_id, 64, 16, {"kind": kind, "kv_format": "auto"})
    return handle


def _routed(request_id: str = "r1") -> Routed:
    routed = Routed(EngineRequest(request_id, list(range(40)), SamplingParams(max_tokens=4)))
    routed.placement = Placement(DISAGGREGATED, "decode-0", "prefill-0", 1.0, 0.5, 40, 0.5)
    routed.decode = "decode-0"
    return routed


class Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[str | None, m.Message]] = []
        self.estimates: list[tuple[str, float]] = []

    def send(self, actor_id, msg) -> None:
        self.sent.append((actor_id, msg))

    def record(self, handle, predicted, observed, uncached) -> None:
        self.estimates.append((handle.actor_id, predicted))


@pytest.fixture
def wire():
    return Wire()


def _handoff(wire: Wire, *routed: Routed) -> Handoff:
    return Handoff({r.request_id: r for r in routed}, wire.send, wire.record, handoff_timeout=30.0)


def test_prefilling_is_reached_only_from_reserving():
    sources = {phase for phase, targets in TRANSITIONS.items() if Phase.PREFILLING in targets}
    assert sources == {Phase.RESERVING}
    routed = _routed()
    with pytest.raises(IllegalTransition):
        routed.move(Phase.PREFILLING)
    assert routed.phase is Phase.PARKED


def test_every_phase_can_be_dispatched_again():
    for phase in Phase:
        assert {Phase.PARKED, Phase.RESERVING, Phase.DECODING} <= TRANSITIONS[phase]


def test_phases_keep_their_wire_names():
    assert [p.value for p in Phase] == ["parked", "reserving", "prefilling", "decoding"]
    assert Phase.PREFILLING == "prefilling"


def test_a_full_handoff_sends_reserve_prefill_commit(wire):
    routed = _routed()
    handoff = _handoff(wire, routed)
    decode, prefill = _handle("decode-0", "decode"), _handle("prefill-0", "prefill")
    handoff.begin(routed)
    assert routed.phase is Phase.RESERVING and isinstance(wire.sent[-1][1], m.ReserveBlocks)
    handoff.on_reserved(decode, m.BlocksReserved("r1", [3, 4, 5], 16))
    target, request = wire.sent[-1]
    assert routed.phase is Phase.PREFILLING and target == "prefill-0"
    assert request.dest_block_ids == [3, 4, 5] and request.skip_blocks == 1 and not request.stream
    handoff.on_kv_ready(prefill, m.KVReady("r1", 7, None, None, 1024, 99))
    target, commit = wire.sent[-1]
    assert routed.phase is Phase.DECODING and target == "decode-0" and commit.first_token == 7
    assert commit.prefilled and commit.checksum == 99
    assert (handoff.counters.kv_transfers, handoff.counters.kv_bytes_transferred) == (1, 1024)
    assert wire.estimates == [("prefill-0", 0.5)]


def test_a_streamed_handoff_reports_its_link_transfer_and_a_written_one_does_not(wire):
    transfers = []
    streamed, written = _routed("r1"), _routed("r2")
    handoff = Handoff({"r1": streamed, "r2": written}, wire.send, wire.record, 30.0,
                      record_transfer=lambda prefill, decode, n, s: transfers.append((prefill.actor_id, decode, n, s)))
    decode, prefill = _handle("decode-0", "decode", "tcp"), _handle("prefill-0", "prefill")
    for routed, rid in ((streamed, "r1"), (written, "r2")):
        handoff.begin(routed)
        handoff.on_reserved(decode, m.BlocksReserved(rid, [3, 4, 5], 0))
    handoff.on_kv_ready(prefill, m.KVReady("r1", 7, None, None, 4096, 1, streamed_bytes=4096, stream_seconds=0.25))
    handoff.on_kv_ready(prefill, m.KVReady("r2", 7, None, None, 4096, 1))
    assert transfers == [("prefill-0", "decode-0", 4096, 0.25)]
    assert handoff.counters.kv_bytes_streamed == 4096


def test_a_reply_from_the_wrong_actor_or_phase_changes_nothing(wire):
    routed = _routed()
    handoff = _handoff(wire, routed)
    handoff.begin(routed)
    handoff.on_kv_ready(_handle("prefill-0", "prefill"), m.KVReady("r1", 7, None, None, 1024, 99))
    handoff.on_reserved(_handle("decode-1", "decode"), m.BlocksReserved("r1", [3], 0))
    assert routed.phase is Phase.RESERVING
    assert wire.sent[-1] == ("decode-1", m.ReleaseReservation("r1"))  # the stray reservation is given back


def test_a_refused_reservation_colocates(wire):
    routed = _routed()
    handoff = _handoff(wire, routed)
    handoff.begin(routed)
    handoff.on_reservation_failed(_handle("decode-0", "decode"), m.ReservationFailed("r1", "full"))
    assert routed.phase is Phase.DECODING and routed.prefill is None
    assert isinstance(wire.sent[-1][1], m.AddRequest) and not wire.sent[-1][1].prefilled


def test_a_failed_prefill_releases_and_colocates(wire):
    routed = _routed()
    handoff = _handoff(wire, routed)
    failover = Failover(None, handoff.routed, handoff, lambda r: None, lambda rid, exc: None, 3, 60.0)
    handoff.begin(routed)
    handoff.on_reserved(_handle("decode-0", "decode"), m.BlocksReserved("r1", [3], 0))
    failover.on_request_failed(_handle("prefill-0", "prefill"), m.RequestFailed("r1", "oom", True))
    assert [type(msg) for _, msg in wire.sent[-2:]] == [m.ReleaseReservation, m.AddRequest]
    assert routed.phase is Phase.DECODING


def test_parked_requests_expire_after_the_park_timeout(wire):
    routed = _routed()
    errors = []
    failover = Failover(None, {"r1": routed}, _handoff(wire), lambda r: None, lambda rid, exc: errors.append(exc),
                        3, park_timeout=60.0)
    failover.park(routed)
    failover.expire_parked(routed.parked_at + 59.0)
    assert failover.parked_count() == 1 and not errors
    failover.expire_parked(routed.parked_at + 61.0)
    assert failover.parked_count() == 0 and isinstance(errors[0], RequestFailedError)


def test_retries_stop_at_max_attempts(wire):
    routed = _routed()
    errors, dispatched = [], []
    failover = Failover(None, {"r1": routed}, _handoff(wire), dispatched.append, lambda rid, exc: errors.append(exc),
                        max_attempts=2, park_timeout=60.0)
    routed.attempts = 1
    failover.retry(routed, "died")
    assert dispatched == [routed] and routed.decode is None and not errors
    routed.attempts = 2
    failover.retry(routed, "died")
    assert "after 2 attempts" in str(errors[0])


def test_a_dead_actors_stream_is_resumed_from_what_it_sent_until_max_migrations(wire):
    routed = _routed()
    routed.request.params = SamplingParams(max_tokens=40, n=2)
    routed.streamed, routed.emitted, routed.finished_samples = True, {0: [7, 8, 9], 1: [5]}, {1}
    errors, dispatched = [], []
    failover = Failover(None, {"r1": routed}, _handoff(wire), dispatched.append, lambda rid, exc: errors.append(exc),
                        3, 60.0, max_migrations=1)
    failover.on_down(_handle("decode-0", "decode"))
    assert dispatched == [routed] and not errors
    assert routed.request.resume == {0: [7, 8, 9]}  # the finished sample is not resumed
    assert routed.moved_from == "decode-0" and routed.decode is None and routed.migrations == 1
    assert (failover.counters.migrations, failover.counters.migrated_tokens) == (1, 3)
    routed.decode = "decode-1"
    failover.on_down(_handle("decode-1", "decode"))
    assert dispatched == [routed] and "already moved 1 times" in str(errors[0])
    assert failover.counters.failed_migrations == 1
