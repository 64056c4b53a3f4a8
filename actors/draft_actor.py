"""The draft actor: a draft model (`--draft-model PATH` or `self:N`) in its own process, with its own paged KV,
proposing tokens for the sequences of the decode actors that connect to it (`actors.remote_proposer`).

Each connection is a session with its own sequence ids, mapped to ids unique in this process; the session's
sequences and their draft KV go when the connection does. A query carries the tokens the session has not sent
before; the draft keeps the longest prefix of its KV that still agrees (rejected drafts roll back). A query whose
deadline has passed by the time it is read only updates the mirror: nobody waits for its answer, so a draft actor
that falls behind catches up without drafting.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil
import torch

from actors.convert import params_from_wire
from actors.spec import ActorSpec
from actors.actor import Actor, integrity_error, send_quietly
from engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from engine.kv.cache import choose_num_blocks
from engine.model.loader import resolve_dtype, resolve_model
from engine.model.progress import READING_CHECKPOINT, WARMING_UP, Progress, report
from engine.sampling.sampling_params import SamplingParams
from engine.speculative.build import draft_net, draft_spare_blocks
from engine.speculative.draft_model import DraftModelProposer
from engine.speculative.proposer import DraftRequest, Proposal
from engine.core.stats import EngineStats
from transport import Connection
from transport import messages as m

log = logging.getLogger("actor")
PROBS_BYTES_BUDGET = 32 << 20  # per reply, well inside a frame; sampled proposals beyond it are dropped


@dataclass
class _Mirror:
    local_id: int
    params: SamplingParams
    seed: int | None
    tokens: list[int] = field(default_factory=list)


class DraftServer:
    """The draft actor's engine (runs on its EngineThread): answers queries, never steps on its own."""

    def __init__(self, proposer: DraftModelProposer, vocab_size: int) -> None:
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.sessions: dict[int, dict[int, _Mirror]] = {}
        self.num_sequences = 0  # kept up to date here, so the loop thread can read it during a call
        self._local_ids = itertools.count()

    def warm_up(self) -> None:
        """One throwaway proposal at start-up: a process's first forward pays one-time costs that would
        otherwise make the first real call miss its deadline (and back the decode actor's speculation off)."""
        local_id = next(self._local_ids)
        self.proposer.propose([DraftRequest(local_id, [1, 2, 3, 4], 2, SamplingParams(temperature=0.0))])
        self.proposer.release(local_id)

    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def answer(self, session: int, msg: m.ProposeDrafts) -> m.DraftProposals:
        seqs = self.sessions.setdefault(session, {})
        mirrors = [self._update(seqs, q) for q in msg.queries]
        resync = [q.seq_id for q, mirror in zip(msg.queries, mirrors) if mirror is None]
        live = [(i, q, mirror) for i, (q, mirror) in enumerate(zip(msg.queries, mirrors)) if mirror is not None]
        self._recount()
        rows = [m.DraftProposal(q.seq_id, []) for q in msg.queries]
        if live and (msg.deadline is None or time.time() < msg.deadline):
            requests = [DraftRequest(mirror.local_id, mirror.tokens, min(q.k, MAX_SPECULATIVE_TOKENS), mirror.params,
                                     mirror.seed) for _, q, mirror in live]
            budget = PROBS_BYTES_BUDGET
            for (i, q, _), proposal in zip(live, self.proposer.propose(requests)):
                rows[i], budget = _row(q.seq_id, proposal, budget)
        return m.DraftProposals(msg.call_id, rows, self.vocab_size, "float32", resync)

    def release(self, session: int, seq_ids: list[int]) -> None:
        seqs = self.sessions.get(session, {})
        for seq_id in seq_ids:
            self._forget(seqs, seq_id)
        self._recount()

    def drop_session(self, session: int) -> None:
        seqs = self.sessions.pop(session, {})
        for seq_id in list(seqs):
            self._forget(seqs, seq_id)
        self._recount()

    def _update(self, seqs: dict[int, _Mirror], q: m.DraftQuery) -> _Mirror | None:
        """The sequence's tokens after this query; None when this side cannot follow (the client resends)."""
        if q.sampling is not None:  # a sequence's first query (or a resend): start it afresh
            self._forget(seqs, q.seq_id)
            seqs[q.seq_id] = _Mirror(next(self._local_ids), params_from_wire(q.sampling), q.seed)
        mirror = seqs.get(q.seq_id)
        if mirror is None or q.num_kept > len(mirror.tokens) or q.num_kept + len(q.new_token_ids) == 0:
            self._forget(seqs, q.seq_id)
            return None
        del mirror.tokens[q.num_kept:]
        mirror.tokens.extend(q.new_token_ids)
        return mirror

    def _recount(self) -> None:
        self.num_sequences = sum(len(seqs) for seqs in self.sessions.values())

    def _forget(self, seqs: dict[int, _Mirror], seq_id: int) -> None:
        mirror = seqs.pop(seq_id, None)
        if mirror is not None:
            self.proposer.release(mirror.local_id)


def _row(seq_id: int, proposal: Proposal, budget: int) -> tuple[m.DraftProposal, int]:
    """The proposal on the wire, and the probability bytes still allowed in this reply."""
    if proposal.draft_probs is None:
        return m.DraftProposal(seq_id, list(proposal.token_ids)), budget
    data = proposal.draft_probs.to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()
    if len(data) > budget:
        return m.DraftProposal(seq_id, []), budget
    return m.DraftProposal(seq_id, list(proposal.token_ids), data), budget - len(data)


def build_draft_server(config: EngineConfig, device: str, progress: Progress | None = None) -> DraftServer:
    """The draft model and a KV pool of its own: the engine's block count (or a share of free memory), plus
    room for every sequence's K draft positions. `progress` hears each stage (engine/model/progress.py)."""
    report(progress, READING_CHECKPOINT)
    source = resolve_model(config.model)
    dtype = resolve_dtype(config.dtype, device)
    net = draft_net(config.draft_model, source, dtype, device, progress=progress)
    num_blocks = choose_num_blocks(net.cfg, config.block_size, dtype, config.num_kv_blocks, config.kv_cache_memory,
                                   psutil.virtual_memory().available) + draft_spare_blocks(config)
    proposer = DraftModelProposer(net, num_blocks, config.block_size, dtype, device)
    return DraftServer(proposer, source.config.vocab_size)


class DraftActor(Actor):
    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec)
        self.engine: DraftServer | None = None
        self._session_ids = itertools.count()
        self._sessions: dict[Connection, int] = {}

    def build_engine(self) -> DraftServer:
        self.engine = build_draft_server(EngineConfig(**self.spec.engine), self.spec.local_device, self.relay.report)
        self.relay.report(WARMING_UP)
        self.engine.warm_up()
        log.info("draft model %s loaded (%d KV blocks)", self.spec.engine.get("draft_model"),
                 self.engine.proposer.pool.num_blocks)
        return self.engine

    def ready_message(self) -> m.Ready:
        pool = self.engine.proposer.pool
        return m.Ready(self.spec.actor_id, pool.num_blocks, pool.block_size, {"kind": "none"}, None)

    def handlers(self) -> dict[type, Callable]:
        return {m.ProposeDrafts: self.on_propose, m.ReleaseDrafts: self.on_release}

    def stats(self) -> EngineStats:
        pool = self.engine.proposer.pool
        return EngineStats(running=self.engine.num_sequences, kv_blocks_total=pool.num_blocks,
                           kv_blocks_used=pool.num_used)

    def deliver(self, outputs: list) -> None:
        """The draft server never steps, so it has no outputs of its own."""

    async def serve_connection(self, conn: Connection) -> None:
        session = self._sessions[conn] = next(self._session_ids)
        try:
            await super().serve_connection(conn)
        finally:
            del self._sessions[conn]
            if self.thread is not None:  # None: the connection ended while the model loaded, with no session state
                self.thread.post(lambda engine: engine.drop_session(session))

    async def on_propose(self, conn: Connection, msg: m.ProposeDrafts) -> None:
        session = self._sessions[conn]
        try:
            reply = await self.thread.submit(lambda engine: engine.answer(session, msg))
        except Exception as exc:  # noqa: BLE001 - a bad query costs the client this step's drafts, nothing more
            log.warning("drafting failed: %r", exc)
            reply = m.Error(f"drafting failed: {exc}")
        await send_quietly(conn, reply)

    async def on_release(self, conn: Connection, msg: m.ReleaseDrafts) -> None:
        session = self._sessions[conn]
        self.thread.post(lambda engine: engine.release(session, msg.seq_ids))

    def integrity_report(self, engine: DraftServer) -> m.IntegrityReport:
        pool = engine.proposer.pool
        return m.IntegrityReport(self.spec.actor_id, integrity_error(pool), pool.num_used, 0, 0, engine.num_sequences)

