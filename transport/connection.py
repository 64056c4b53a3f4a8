"""`Connection`: typed messages over one stream, and the client-side ways to open one.

A connection that receives a malformed or oversized frame logs one line and closes itself: past a bad frame
the byte stream cannot be trusted. Errors: `ProtocolError` (bad bytes), `ConnectionClosed` (peer gone or
already closed), `TimeoutError` (a `timeout=` ran out), `AuthenticationError` (TCP handshake); opening a
connection may also raise `OSError` (no such socket, refused).
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl as ssl_module

from transport import auth
from transport.codec import Limits, decode, encode_parts
from transport.errors import ConnectionClosed, ProtocolError
from transport.framing import (MAX_FRAME_BYTES, STREAM_BUFFER_LIMIT, read_frame_body, read_frame_header,
                               write_frame)
from transport.messages import Message

log = logging.getLogger("phase_serve.transport")


class Connection:
    """One peer. Any number of tasks may `send` concurrently; one task at a time may `recv`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 max_frame: int = MAX_FRAME_BYTES, peer: str = "") -> None:
        self._reader, self._writer = reader, writer
        self._limits = Limits(max_bytes=max_frame)
        self._send_lock = asyncio.Lock()
        self._closed = False
        self.peer = peer or _peer_name(writer)
        self.local_address = writer.get_extra_info("sockname")  # (host, port) for TCP

    @property
    def max_frame(self) -> int:
        return self._limits.max_bytes

    @property
    def closed(self) -> bool:
        return self._closed or self._writer.is_closing()

    async def send(self, msg: Message, *, timeout: float | None = None) -> None:
        """Queues `msg` and waits until the socket buffer drains (flow control). A ProtocolError here (bad
        message) sends nothing and leaves the connection open; a timeout leaves the frame queued, intact."""
        parts = encode_parts(msg, self._limits)
        async with self._send_lock:
            self._ensure_open()
            write_frame(self._writer, parts, self.max_frame)
            try:
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
            except OSError as exc:
                self.close(abort=True)
                raise ConnectionClosed(f"{self.peer}: connection lost: {exc}") from None

    async def recv(self, *, timeout: float | None = None) -> Message:
        """The next message. ConnectionClosed at end of stream; ProtocolError (and the connection closes) for a
        bad frame; TimeoutError after `timeout` seconds (the connection stays usable if no byte had arrived)."""
        self._ensure_open()
        try:
            async with asyncio.timeout(timeout):
                body = await self._read_body()
            return decode(body, self._limits)
        except ProtocolError as exc:
            self._fail(exc)
            raise
        except ConnectionClosed:
            self.close(abort=True)
            raise

    async def _read_body(self) -> bytes:
        size = await read_frame_header(self._reader, self.max_frame)
        try:
            return await read_frame_body(self._reader, size)
        except BaseException:
            self.close(abort=True)  # cut off mid-frame (timeout, cancel, EOF): the stream cannot resynchronise
            raise

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> Message:
        """Messages until the peer closes; a ProtocolError still raises."""
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    def close(self, *, abort: bool = False) -> None:
        """Closes the stream: flushing queued frames first, or dropping them with `abort`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if abort:
            self._writer.transport.abort()
        else:
            self._writer.close()

    async def aclose(self) -> None:
        self.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _ensure_open(self) -> None:
        if self.closed:
            raise ConnectionClosed(f"{self.peer}: connection is closed")

    def _fail(self, exc: ProtocolError) -> None:
        log.warning("transport: closing connection %s: %s", self.peer, exc)
        self.close(abort=True)

    def __repr__(self) -> str:
        return f"Connection({self.peer!r}, {'closed' if self.closed else 'open'})"


def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple):
        return f"tcp:{peer[0]}:{peer[1]}"
    return f"unix:{writer.get_extra_info('sockname') or peer or '?'}"


async def connect_unix(path: str | os.PathLike[str], *, max_frame: int = MAX_FRAME_BYTES,
                       timeout: float | None = None) -> Connection:
    """Connects to `serve_unix`'s socket at `path`."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_unix_connection(os.fspath(path), limit=STREAM_BUFFER_LIMIT)
    return Connection(reader, writer, max_frame=max_frame, peer=f"unix:{os.fspath(path)}")


async def connect_tcp(host: str, port: int, secret: bytes, *, max_frame: int = MAX_FRAME_BYTES,
                      timeout: float = auth.DEFAULT_HANDSHAKE_TIMEOUT,
                      ssl: ssl_module.SSLContext | None = None) -> Connection:
    """Connects to `serve_tcp` and runs the shared-secret handshake, all within `timeout` seconds."""
    auth.check_secret(secret)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port, limit=STREAM_BUFFER_LIMIT, ssl=ssl)
        try:
            await auth.client_handshake(reader, writer, secret)
        except BaseException:
            writer.transport.abort()
            raise
    return Connection(reader, writer, max_frame=max_frame, peer=f"tcp:{host}:{port}")
