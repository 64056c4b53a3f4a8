"""Per-request treatment: what the engine does for one request beyond its sampling parameters. Declared with the
messages (`transport.messages.Treatment`, the lowest layer) because it travels in AddRequest unchanged; the server
picks it (server.quadrant.treatment_for), the engine acts on it (EngineRequest)."""
from transport.messages import Treatment

__all__ = ["Treatment"]
