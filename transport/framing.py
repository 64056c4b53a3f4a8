"""Frames on a byte stream: a 4-byte big-endian body length, then the body (one encoded message).

The length is checked against the reader's limit before a single body byte is read, so a hostile prefix
costs nothing. These functions do not close anything; `Connection` decides what a failure means.

Out-of-band frames (KV pages, transport.kv_stream) are an ordinary frame whose message declares a payload
size, followed by that many raw bytes that are no part of the msgpack body: the sender writes them straight
from the tensor's memory (`send_buffers`, one `sendmsg` of memoryviews) and the receiver reads them into a
buffer it already holds (`recv_exactly_into`), so the payload is never copied into or out of msgpack."""
from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Sequence

from transport.codec import MAX_MESSAGE_BYTES
from transport.errors import ConnectionClosed, ProtocolError

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
"""Default frame limit: room for one layer's KV pages of a long prompt."""
CONTROL_FRAME_BYTES = 4 << 20
"""A tighter limit for connections that carry only control messages (a 500k-token prompt still fits)."""
STREAM_BUFFER_LIMIT = 4 << 20
"""asyncio stream buffer: a reader pauses the socket above twice this, so big frames need fewer wake-ups."""


def check_frame_size(size: int, max_size: int) -> None:
    if size > max_size:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_size}")


async def read_frame_header(reader: asyncio.StreamReader, max_size: int) -> int:
    """The next frame's body length. ConnectionClosed at end of stream, ProtocolError if over `max_size`."""
    header = await read_exactly(reader, HEADER.size)
    (size,) = HEADER.unpack(header)
    check_frame_size(size, max_size)
    return size


async def read_frame_body(reader: asyncio.StreamReader, size: int) -> bytes:
    return await read_exactly(reader, size)


async def read_frame(reader: asyncio.StreamReader, max_size: int) -> bytes:
    return await read_frame_body(reader, await read_frame_header(reader, max_size))


def write_frame(writer: asyncio.StreamWriter, parts: Sequence[bytes], max_size: int) -> None:
    """Queues one frame in a single call, so frames from concurrent senders never interleave."""
    size = sum(len(p) for p in parts)
    check_frame_size(size, max_size)
    writer.writelines([HEADER.pack(size), *parts])


async def read_exactly(reader: asyncio.StreamReader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed(f"peer closed the connection ({len(exc.partial)} of {n} bytes read)") from None
    except OSError as exc:  # ConnectionResetError and friends
        raise ConnectionClosed(f"connection lost: {exc}") from None


# ---- blocking sockets (threads that stream KV pages) ------------------------------------------------------

SENDMSG_MAX_BUFFERS = 512  # under IOV_MAX (1024 on Linux)


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
    """Writes every buffer, in order, with as few `sendmsg` calls as the kernel allows: no buffer is copied or
    joined; a partial send resumes from a memoryview slice. Returns the bytes written; OSError as the socket
    raises it (the stream is then unusable: part of a frame may be out)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    while views:
        sent = sock.sendmsg(views[:SENDMSG_MAX_BUFFERS])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0
    return total


def frame_buffers(body_parts: Sequence[bytes], max_size: int) -> list[bytes]:
    """One frame's header and body parts, ready for `send_buffers` (out-of-band payloads go after them)."""
    size = sum(len(p) for p in body_parts)
    check_frame_size(size, max_size)
    return [HEADER.pack(size), *body_parts]


def recv_exactly_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket; ConnectionClosed if the peer ends the stream first or resets it."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except (TimeoutError, socket.timeout):
            raise
        except OSError as exc:
            raise ConnectionClosed(f"connection lost: {exc}") from None
        if k == 0:
            raise ConnectionClosed(f"peer closed the connection ({got} of {n} bytes read)")
        got += k


def recv_frame_body(sock: socket.socket, max_size: int) -> bytearray:
    """The next frame's body from a blocking socket; ProtocolError before reading a body over `max_size`."""
    header = bytearray(HEADER.size)
    recv_exactly_into(sock, memoryview(header))
    (size,) = HEADER.unpack(header)
    check_frame_size(size, max_size)
    body = bytearray(size)
    recv_exactly_into(sock, memoryview(body))
    return body
