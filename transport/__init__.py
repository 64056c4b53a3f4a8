"""Typed msgpack messages between the main process and its actors, over Unix sockets or authenticated TCP.

    from transport import serve_unix, connect_unix, messages as m
    server = await serve_unix(None, handler)          # handler(conn) gets each accepted Connection
    conn = await connect_unix(server.address)
    await conn.send(m.Heartbeat(seq=1, time=time.time()))
    reply = await conn.recv(timeout=2.0)

See messages.py (every message), codec.py (wire format), auth.py (TCP handshake)."""
from transport.auth import SECRET_ENV, load_secret, write_secret_file
from transport.codec import DEFAULT_LIMITS, Limits, decode, encode, encode_parts
from transport.connection import Connection, connect_tcp, connect_unix
from transport.errors import AuthenticationError, ConnectionClosed, ProtocolError, TransportError
from transport.framing import CONTROL_FRAME_BYTES, MAX_FRAME_BYTES
from transport.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, Record
from transport.server import Handler, TransportServer, private_socket_dir, serve_tcp, serve_unix

__all__ = [
    "AuthenticationError", "CONTROL_FRAME_BYTES", "Connection", "ConnectionClosed", "DEFAULT_LIMITS", "Handler",
    "Limits", "MAX_FRAME_BYTES", "MESSAGE_TYPES", "Message", "PROTOCOL_VERSION", "ProtocolError", "Record",
    "SECRET_ENV", "TransportError", "TransportServer", "connect_tcp", "connect_unix", "decode", "encode",
    "encode_parts", "load_secret", "private_socket_dir", "serve_tcp", "serve_unix", "write_secret_file",
]
