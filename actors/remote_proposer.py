"""A decode actor's client of its draft actor: a `Proposer` whose drafts come from another process.

The engine calls it from its step thread, so it speaks over a blocking socket with a short deadline per call.
A timeout or a lost connection makes that call raise (the step runs without speculation) and turns
speculation off for a back-off period that doubles while failures repeat; then it tries again, reconnecting
if need be (the supervisor restarts a dead draft actor on the same socket path). While backing off, or while no
draft actor listens yet, it quietly proposes nothing: requests go on, verified by the target as always.

Both ends mirror each sequence's tokens, so a query carries only what the draft actor has not seen. A new
connection starts from nothing on both sides.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from actors.convert import params_to_wire
from actors.spec import Role
from engine.speculative.proposer import DraftRequest, Proposal
from transport import messages as m
from transport.blocking import BlockingConnection
from transport.errors import ProtocolError, TransportError

log = logging.getLogger(__name__)
PROBS_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class RemoteDraftSettings:
    deadline: float = 0.25  # seconds a step waits for its drafts (connecting included)
    backoff: float = 1.0  # speculation off this long after a failure, doubling while failures repeat
    max_backoff: float = 8.0


class DraftUnavailable(RuntimeError):
    """The draft actor did not answer in time or went away; this step runs without speculation."""


class RemoteProposer:
    def __init__(self, socket_path: str, device: torch.device | str = "cpu",
                 settings: RemoteDraftSettings = RemoteDraftSettings(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """clock times the back-off only (tests pass a fake one); socket deadlines always use time.monotonic."""
        self.socket_path = socket_path
        self.clock = clock
        self.device = device
        self.settings = settings
        self._conn: BlockingConnection | None = None
        self._sent: dict[int, list[int]] = {}  # seq id -> the tokens the draft actor holds for it
        self._call_ids = itertools.count(1)
        self._retry_at = 0.0
        self._failures = 0  # consecutive
        self.num_failures = 0  # total, for tests and logs

    @property
    def backing_off(self) -> bool:
        return self.clock() < self._retry_at

    # ------------------------------------------------------------------ Proposer interface

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        asked = [i for i, r in enumerate(requests) if r.k > 0]
        if not asked or self.backing_off:
            return proposals
        deadline = time.monotonic() + self.settings.deadline
        if self._conn is None and not self._connect(deadline):
            return proposals
        queries = [self._query(requests[i]) for i in asked]
        try:
            reply = self._call(m.ProposeDrafts(next(self._call_ids), queries, time.time() + self.settings.deadline),
                               deadline)
            got = self._unpack(reply, queries)
        except (OSError, TransportError, ValueError) as exc:  # TimeoutError is an OSError
            self._fail(exc)
            raise DraftUnavailable(f"draft actor at {self.socket_path}: {exc!r}") from exc
        self._failures = 0
        for i, proposal in zip(asked, got):
            proposals[i] = proposal
        return proposals

    def on_accepted(self, seq_id: int, num_tokens_kept: int) -> None:
        """Nothing to send: the next query's tokens tell the draft actor what is final, and it rolls back."""

    def release(self, seq_id: int) -> None:
        """Never raises: the engine calls this outside its proposer error handling."""
        if self._sent.pop(seq_id, None) is None or self._conn is None:
            return
        try:
            self._conn.send(m.ReleaseDrafts([seq_id]), time.monotonic() + self.settings.deadline)
        except (OSError, TransportError) as exc:
            self._fail(exc)

    def close(self) -> None:
        self._disconnect()

    # ------------------------------------------------------------------ one call

    def _query(self, request: DraftRequest) -> m.DraftQuery:
        """Only what the draft actor has not seen; the mirror is updated now, as the actor will update its own
        when it reads the query (even one whose answer comes too late)."""
        tokens = list(request.token_ids)
        sent = self._sent.get(request.seq_id)
        self._sent[request.seq_id] = tokens
        if sent is None:
            return m.DraftQuery(request.seq_id, 0, tokens, request.k, params_to_wire(request.params), request.seed)
        keep = _common_prefix(sent, tokens)
        return m.DraftQuery(request.seq_id, keep, tokens[keep:], request.k)

    def _call(self, msg: m.ProposeDrafts, deadline: float) -> m.DraftProposals:
        self._conn.send(msg, deadline)
        while True:  # answers to earlier calls that timed out arrive first: skip them
            reply = self._conn.recv(deadline)
            if isinstance(reply, m.DraftProposals) and reply.call_id == msg.call_id:
                return reply
            if isinstance(reply, m.Error):
                raise ProtocolError(f"the draft actor reports: {reply.message}")

    def _unpack(self, reply: m.DraftProposals, queries: list[m.DraftQuery]) -> list[Proposal]:
        if len(reply.proposals) != len(queries):
            raise ProtocolError(f"{len(reply.proposals)} proposals for {len(queries)} queries")
        for seq_id in reply.resync:
            self._sent.pop(seq_id, None)
        return [self._proposal(row, reply) for row in reply.proposals]

    def _proposal(self, row: m.DraftProposal, reply: m.DraftProposals) -> Proposal:
        if row.probs is None:
            return Proposal(list(row.token_ids))
        dtype = PROBS_DTYPES.get(reply.probs_dtype)
        shape = (len(row.token_ids), reply.vocab_size)
        if dtype is None or len(row.probs) != shape[0] * shape[1] * dtype.itemsize:
            raise ProtocolError(f"draft probabilities: {len(row.probs)} bytes of {reply.probs_dtype} for {shape}")
        probs = torch.frombuffer(bytearray(row.probs), dtype=dtype).view(shape)
        return Proposal(list(row.token_ids), probs.to(device=self.device, dtype=torch.float32))

    # ------------------------------------------------------------------ connection and back-off

    def _connect(self, deadline: float) -> bool:
        """Open and check the greeting. Nobody listening (not started yet, restarting) is not an error of this
        step: no proposals, and the next try after a back-off."""
        try:
            conn = BlockingConnection.open_unix(self.socket_path, deadline)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self._back_off()
            return False
        except OSError as exc:
            self._fail(exc)
            raise DraftUnavailable(f"cannot connect to the draft actor at {self.socket_path}: {exc!r}") from exc
        try:
            ready = _check_greeting(conn.recv(deadline), conn.recv(deadline))
        except (OSError, TransportError) as exc:
            conn.close()
            self._fail(exc)
            raise DraftUnavailable(f"the draft actor at {self.socket_path} did not greet: {exc!r}") from exc
        if not ready:  # still loading its model: as if it did not listen yet
            conn.close()
            self._back_off()
            return False
        self._conn = conn
        log.info("connected to the draft actor at %s", self.socket_path)
        return True

    def _fail(self, exc: BaseException) -> None:
        """Only a receive that ran out of time keeps the connection: the query went out whole, so both mirrors
        still agree and the late answer will be skipped. After anything else, start afresh on both sides."""
        self.num_failures += 1
        if not isinstance(exc, TimeoutError):
            self._disconnect()
        delay = self._back_off()
        log.warning("draft actor at %s failed (%r): speculation off for %.1fs", self.socket_path, exc, delay)

    def _back_off(self) -> float:
        self._failures += 1
        delay = min(self.settings.backoff * 2 ** (self._failures - 1), self.settings.max_backoff)
        self._retry_at = self.clock() + delay
        return delay

    def _disconnect(self) -> None:
        """The actor drops a connection's state with it, so this side forgets what it had sent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._sent.clear()


def _check_greeting(hello: m.Message, ready: m.Message) -> bool:
    """True for Hello and Ready; False for Hello and StartupProgress (the actor is still loading)."""
    if not isinstance(hello, m.Hello) or not isinstance(ready, (m.Ready, m.StartupProgress)):
        raise ProtocolError(f"expected Hello and Ready, got {type(hello).__name__}, {type(ready).__name__}")
    if hello.role != Role.DRAFT or hello.protocol_version != m.PROTOCOL_VERSION:
        raise ProtocolError(f"expected a draft actor speaking protocol {m.PROTOCOL_VERSION}, got a {hello.role} "
                            f"actor speaking {hello.protocol_version}")
    return isinstance(ready, m.Ready)


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == list(b[:n]):  # the usual case: the sequence grew by the tokens accepted last step
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
