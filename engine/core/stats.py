"""EngineStats: the one record of an engine's queues, KV pool and counters. It is declared with the messages
(`transport.messages.EngineStats`, the lowest layer) because it travels in every heartbeat unchanged; the engine,
the router's totals, /status and /metrics all use it under the same field names."""
from transport.messages import EngineStats

__all__ = ["EngineStats"]
