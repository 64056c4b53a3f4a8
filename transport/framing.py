"""Frames on a byte stream: a 4-byte big-endian body length, then the body (one encoded message).

The length is checked against the reader's limit before a single body byte is read, so a hostile prefix
costs nothing. These functions do not close anything; `Connection` decides what a failure means."""
from __future__ import annotations

import asyncio
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
