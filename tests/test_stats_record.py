"""One stats record from the engine to the wire and back: one declaration, a lossless round trip through the
codec, one helper that totals several engines; and EngineThread's explicit post / post_outputs."""
import asyncio
from dataclasses import fields

from engine.core.engine_thread import EngineThread
from engine.core.stats import EngineStats
from transport import decode, encode
from transport import messages as m

SAMPLE = EngineStats(running=2, waiting=1, kv_blocks_total=64, kv_blocks_used=10, kv_blocks_cached=3,
                     prefix_queries=9, prefix_hits=4, num_preemptions=1, spec_proposed=12, spec_accepted=7,
                     spec_steps=5, kv_bytes_per_token=18432.0, kv_blocks_compressed=2, kv_blocks_cold_total=16,
                     kv_compressions=6)


def test_the_engine_and_the_wire_share_one_declaration():
    assert EngineStats is m.EngineStats
    assert [f.name for f in fields(EngineStats)][:3] == ["running", "waiting", "kv_blocks_total"]


def test_stats_survive_a_heartbeat_unchanged():
    ack = decode(encode(m.HeartbeatAck(3, 1.5, SAMPLE)))
    assert ack.seq == 3 and ack.stats == SAMPLE and type(ack.stats) is EngineStats


def test_total_adds_counts_and_keeps_the_largest_bytes_per_token():
    other = EngineStats(running=1, kv_blocks_total=32, spec_proposed=3, kv_bytes_per_token=9216.0)
    total = EngineStats.total([SAMPLE, other])
    assert (total.running, total.kv_blocks_total, total.spec_proposed) == (3, 96, 15)
    assert total.kv_bytes_per_token == 18432.0 and total.kv_compressions == 6
    assert EngineStats.total([]) == EngineStats()


class _Idle:
    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        return []


async def test_post_drops_results_and_post_outputs_delivers_them():
    delivered = []
    thread = EngineThread(_Idle(), asyncio.get_running_loop(), delivered.append, lambda exc: None)
    try:
        thread.post(lambda engine: ["dropped"])
        thread.post_outputs(lambda engine: ["delivered"])
        thread.post_outputs(lambda engine: [])
        await thread.submit(lambda engine: None)  # runs after both posts; their deliveries are queued before it
        assert delivered == [["delivered"]]
    finally:
        thread.shutdown()
