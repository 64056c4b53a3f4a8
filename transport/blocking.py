"""`BlockingConnection`: the same frames and codec as `Connection`, over a blocking Unix socket, for callers that
live on a plain thread (the engine's step thread) and need a hard deadline on every call.

Received bytes are buffered until a whole frame is there, so a receive that runs out of time leaves the stream
intact: the late frame is simply read by the next call. A send that runs out of time may have written part of a
frame, so it closes the connection. Errors: `TimeoutError` (deadline passed, connection still usable),
`ConnectionClosed` (peer gone, or this side closed after a failed send), `ProtocolError` (bad frame; closes).
"""
from __future__ import annotations

import os
import socket
import time

from transport.codec import Limits, decode, encode_parts
from transport.errors import ConnectionClosed, ProtocolError
from transport.framing import HEADER, MAX_FRAME_BYTES, check_frame_size
from transport.messages import Message

RECV_CHUNK = 1 << 20


class BlockingConnection:
    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._limits = Limits(max_bytes=max_frame)
        self._buffer = bytearray()
        self._closed = False

    @classmethod
    def open_unix(cls, path: str | os.PathLike[str], deadline: float,
                  max_frame: int = MAX_FRAME_BYTES) -> BlockingConnection:
        """Connects to a Unix socket; `deadline` is on the monotonic clock. OSError if nobody listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(os.fspath(path))
        except BaseException:
            sock.close()
            raise
        return cls(sock, max_frame)

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, msg: Message, deadline: float) -> None:
        parts = encode_parts(msg, self._limits)
        size = sum(len(p) for p in parts)
        check_frame_size(size, self._limits.max_bytes)
        self._ensure_open()
        try:
            self._sock.settimeout(_remaining(deadline))
            self._sock.sendall(b"".join([HEADER.pack(size), *parts]))
        except OSError as exc:  # TimeoutError included: part of a frame may be out, the stream is lost
            self.close()
            raise ConnectionClosed(f"send failed: {exc!r}") from None

    def recv(self, deadline: float) -> Message:
        """The next message, waiting at most until `deadline` (monotonic)."""
        while True:
            msg = self._take_frame()
            if msg is not None:
                return msg
            self._fill(deadline)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def _take_frame(self) -> Message | None:
        if len(self._buffer) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self._buffer)
        try:
            check_frame_size(size, self._limits.max_bytes)
        except ProtocolError:
            self.close()
            raise
        end = HEADER.size + size
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[HEADER.size:end])
        del self._buffer[:end]
        try:
            return decode(body, self._limits)
        except ProtocolError:
            self.close()
            raise

    def _fill(self, deadline: float) -> None:
        self._ensure_open()
        try:
            self._sock.settimeout(_remaining(deadline))
            chunk = self._sock.recv(RECV_CHUNK)
        except TimeoutError:
            raise
        except OSError as exc:
            self.close()
            raise ConnectionClosed(f"receive failed: {exc!r}") from None
        if not chunk:
            self.close()
            raise ConnectionClosed("the peer closed the connection")
        self._buffer += chunk

    def _ensure_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("connection is closed")


def _remaining(deadline: float) -> float:
    """Seconds left (a zero timeout would make the socket non-blocking, so an expired deadline raises)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
