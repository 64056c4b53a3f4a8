"""The prefill actor: runs prompts straight into attached decode actors' KV pools and reports the first token.

A decode actor on another host that offers a KV endpoint (Ready.kv_export kind "tcp") gets its pages on one
kept-open stream from this actor (transport.kv_stream), layer by layer while the prefill runs; KVReady goes
to the router only once that actor has acknowledged every page, so the commit that follows finds them in."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable
from functools import partial

from actors.actor import RESERVATION_SWEEP_SECONDS, Actor, to_monotonic
from actors.convert import logprobs_to_wire, params_from_wire
from engine.core.builder import build_prefill_engine
from engine.kv.export import open_shared_pool
from engine.core.constraints import compile_constraint
from engine.core.calibration import calibrate_prefill_engine, warm_up_prefill
from engine.core.calibration_store import start_calibration
from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.core.prefill_engine import PrefillEngine, PrefillJob, PrefillResult
from engine.core.stats import EngineStats
from transport import Connection, load_secret
from transport import messages as m
from transport.kv_stream import KVStreamSender

log = logging.getLogger("actor")


class PrefillActor(Actor):
    """Runs prompts straight into attached decode actors' pools and reports the first token."""

    links: dict[str, KVStreamSender]  # decode actor id -> the stream to its KV endpoint (another host)

    def build_engine(self) -> PrefillEngine:
        with self.startup.stage("engine"):
            self.engine = build_prefill_engine(EngineConfig(**self.spec.engine), device=self.spec.local_device,
                                               progress=self.relay.report, check_memory=self.spec.remote,
                                               loaded=self.loaded)
        with self.startup.stage("calibration"):
            self.calibration = start_calibration(self.engine, self.spec.calibration,
                                                 partial(calibrate_prefill_engine, progress=self.relay.report),
                                                 warm_up_prefill, log)
        return self.engine

    def start_tasks(self) -> None:
        self.links = {}
        self.tasks.append(self.loop.create_task(self._sweep_deadlines()))

    def release(self) -> None:
        for link in self.links.values():
            link.close()

    def ready_message(self) -> m.Ready:
        return m.Ready(self.spec.actor_id, 0, self.engine.config.block_size, {"kind": "none"},
                       self.calibration.to_wire(), self.engine.runner.backend.describe())

    def handlers(self) -> dict[type, Callable]:
        return {m.PrefillRequest: self.on_prefill, m.AbortRequest: self.on_abort, m.AttachPool: self.on_attach,
                m.DetachPool: self.on_detach}

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.engine.jobs))

    async def on_attach(self, conn: Connection, msg: m.AttachPool) -> None:
        if msg.kv_export.get("kind") == "tcp":
            self._link(msg.actor_id, msg.kv_export)
            return
        storage = open_shared_pool(msg.kv_export)
        cfg = self.engine.source.config
        kv = KVCache.from_export(cfg, msg.num_blocks, msg.block_size, storage, msg.kv_export, self.engine.dtype)
        self.thread.post(lambda engine: engine.attach_pool(msg.actor_id, kv))

    def _link(self, actor_id: str, export: dict) -> None:
        """Stream to `actor_id`'s endpoint from now on (it connects on first use), or relay without a secret."""
        try:
            secret = load_secret()
        except ValueError as exc:
            log.warning("no direct KV stream to %s (%s): its pages go through the server", actor_id, exc)
            return
        old = self.links.pop(actor_id, None)
        if old is not None:
            old.close()
        self.links[actor_id] = KVStreamSender(export["host"], int(export["port"]), secret, name=actor_id)

    async def on_detach(self, conn: Connection, msg: m.DetachPool) -> None:
        link = self.links.pop(msg.actor_id, None)
        if link is not None:
            link.close()
        dropped = await self.thread.submit(lambda engine: engine.detach_pool(msg.actor_id))
        for rid in dropped:
            self.send_to_owner(rid, m.RequestFailed(rid, f"{msg.actor_id} went away", True), finished=True)

    async def on_prefill(self, conn: Connection, msg: m.PrefillRequest) -> None:
        job = PrefillJob(msg.request_id, msg.prompt_token_ids, params_from_wire(msg.sampling), msg.dest_block_ids,
                         msg.skip_blocks * self.engine.config.block_size, msg.dest_actor_id,
                         to_monotonic(msg.deadline), num_prompt_tokens=msg.num_prompt_tokens)
        self.owners[msg.request_id] = conn
        try:
            if job.params.guide is not None:  # compiled off both the loop and the step thread
                await asyncio.to_thread(compile_constraint, self.engine.source, job.params.guide)
            if msg.stream:
                sink = self.links.get(msg.dest_actor_id)
                await self.thread.submit(lambda engine: engine.add_streamed(job, msg.kv_format, sink))
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
            if res.sink is not None:  # its pages are on the direct stream: ready once they are acknowledged
                res.sink.end(res.request_id, res.deadline, self._stream_done(res))
                continue
            for layer, payload in enumerate(res.pages or ()):  # sent in order, before KVReady
                self.send_to_owner(res.request_id, m.KVPages(res.request_id, layer, res.dest_block_ids, payload))
            self._ready(res, 0)

    def _ready(self, res: PrefillResult, streamed_bytes: int, stream_seconds: float = 0.0) -> None:
        logprob, top = logprobs_to_wire(res.logprobs)
        msg = m.KVReady(res.request_id, res.first_token, logprob, top, res.num_bytes, res.checksum,
                        res.num_cached_tokens, streamed_bytes, stream_seconds)
        self.send_to_owner(res.request_id, msg, finished=True)

    def _stream_done(self, res: PrefillResult) -> Callable[[int, str | None], None]:
        """The direct stream's completion (on its thread): KVReady, or a retryable failure, from the loop."""
        def done(num_bytes: int, error: str | None, seconds: float) -> None:
            if error is None:
                self.loop.call_soon_threadsafe(self._ready, res, num_bytes, seconds)
            else:
                failed = m.RequestFailed(res.request_id, f"KV stream to the decode actor: {error}", True)
                self.loop.call_soon_threadsafe(lambda: self.send_to_owner(res.request_id, failed, finished=True))
        return done

    async def _sweep_deadlines(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(RESERVATION_SWEEP_SECONDS)
            late = await self.thread.submit(lambda engine: engine.expire())
            for rid in late:
                self.send_to_owner(rid, m.RequestFailed(rid, "prefill missed its deadline", True), finished=True)
