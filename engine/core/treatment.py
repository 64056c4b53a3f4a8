"""Per-request treatment: what the engine does for one request beyond its sampling parameters.

Pure data: the server picks it (server.quadrant.treatment_for), the engine acts on it (EngineRequest).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Treatment:
    """Chosen per quadrant by the server (server.quadrant.treatment_for), carried by EngineRequest.
    `speculate`: speculative decoding on/off, None = the engine's default (on when a proposer is configured).
    `compress_first`: with --kv-compress, this request's old pages are compressed before other requests'."""

    speculate: bool | None = None
    compress_first: bool = False
