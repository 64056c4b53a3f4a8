"""The transport's exceptions. Callers catch `TransportError` for "this peer is gone or misbehaving"."""
from __future__ import annotations


class TransportError(Exception):
    """Base of every error the transport raises on purpose."""


class ProtocolError(TransportError):
    """Bytes that are not a valid message: garbage, unknown tag, wrong fields, too deep, too large.

    On a connection this is fatal: the stream cannot be trusted past a bad frame, so it is closed."""


class ConnectionClosed(TransportError):
    """The peer closed (or reset) the connection, or this side closed it already."""


class AuthenticationError(TransportError):
    """The TCP shared-secret handshake failed: wrong secret, wrong protocol, or the peer hung up."""
