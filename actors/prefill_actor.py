"""The prefill actor: runs prompts straight into attached decode actors' KV pools and reports the first token."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from actors.actor import RESERVATION_SWEEP_SECONDS, Actor, to_monotonic
from actors.convert import logprobs_to_wire, params_from_wire
from engine.kv.export import open_shared_pool
from engine.calibration import Calibration, calibrate_prefill_engine, log_calibration
from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.prefill_engine import PrefillEngine, PrefillJob, PrefillResult
from engine.stats import EngineStats
from transport import Connection
from transport import messages as m

log = logging.getLogger("actor")


class PrefillActor(Actor):
    """Runs prompts straight into attached decode actors' pools and reports the first token."""

    def build_engine(self) -> PrefillEngine:
        with self.startup.stage("engine"):
            self.engine = PrefillEngine(EngineConfig(**self.spec.engine), device=self.spec.local_device)
        with self.startup.stage("calibration"):
            if self.spec.calibration is None:
                self.calibration = calibrate_prefill_engine(self.engine)
                log_calibration(self.calibration, log)
            else:
                self.calibration = Calibration.from_wire(self.spec.calibration)
        return self.engine

    def start_tasks(self) -> None:
        self.loop.create_task(self._sweep_deadlines())

    def ready_message(self) -> m.Ready:
        return m.Ready(self.spec.actor_id, 0, self.engine.config.block_size, {"kind": "none"},
                       self.calibration.to_wire(), self.engine.runner.backend.describe())

    def handlers(self) -> dict[type, Callable]:
        return {m.PrefillRequest: self.on_prefill, m.AbortRequest: self.on_abort, m.AttachPool: self.on_attach,
                m.DetachPool: self.on_detach}

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.engine.jobs))

    async def on_attach(self, conn: Connection, msg: m.AttachPool) -> None:
        storage = open_shared_pool(msg.kv_export)
        cfg = self.engine.source.config
        kv = KVCache.from_export(cfg, msg.num_blocks, msg.block_size, storage, msg.kv_export, self.engine.dtype)
        self.thread.post(lambda engine: engine.attach_pool(msg.actor_id, kv))

    async def on_detach(self, conn: Connection, msg: m.DetachPool) -> None:
        dropped = await self.thread.submit(lambda engine: engine.detach_pool(msg.actor_id))
        for rid in dropped:
            self.send_to_owner(rid, m.RequestFailed(rid, f"{msg.actor_id} went away", True), finished=True)

    async def on_prefill(self, conn: Connection, msg: m.PrefillRequest) -> None:
        job = PrefillJob(msg.request_id, msg.prompt_token_ids, params_from_wire(msg.sampling), msg.dest_block_ids,
                         msg.skip_blocks * self.engine.config.block_size, msg.dest_actor_id,
                         to_monotonic(msg.deadline), num_prompt_tokens=msg.num_prompt_tokens)
        self.owners[msg.request_id] = conn
        try:
            if msg.stream:
                await self.thread.submit(lambda engine: engine.add_streamed(job, msg.kv_format))
            else:
                await self.thread.submit(lambda engine: engine.add(job))
        except Exception as exc:
            self.owners.pop(msg.request_id, None)
            await conn.send(m.RequestFailed(msg.request_id, str(exc), True))

    async def on_abort(self, conn: Connection, msg: m.AbortRequest) -> None:
        self.owners.pop(msg.request_id, None)
        self.thread.post(lambda engine: engine.abort(msg.request_id))

    def on_owner_lost(self, request_id: str) -> None:
        super().on_owner_lost(request_id)
        self.thread.post(lambda engine: engine.abort(request_id))

    def abort_everything(self, engine: PrefillEngine) -> None:
        for rid in list(engine.jobs):
            engine.abort(rid)

    def deliver(self, outputs: list[PrefillResult]) -> None:
        for res in outputs:
            for layer, payload in enumerate(res.pages or ()):  # sent in order, before KVReady
                self.send_to_owner(res.request_id, m.KVPages(res.request_id, layer, res.dest_block_ids, payload))
            logprob, top = logprobs_to_wire(res.logprobs)
            msg = m.KVReady(res.request_id, res.first_token, logprob, top, res.num_bytes, res.checksum,
                            res.num_cached_tokens)
            self.send_to_owner(res.request_id, msg, finished=True)

    async def _sweep_deadlines(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(RESERVATION_SWEEP_SECONDS)
            late = await self.thread.submit(lambda engine: engine.expire())
            for rid in late:
                self.send_to_owner(rid, m.RequestFailed(rid, "prefill missed its deadline", True), finished=True)
