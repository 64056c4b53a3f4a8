"""Direct KV page streams between hosts: a prefill actor's kept-open, authenticated TCP connection to a decode
actor on another host, carrying each layer's pages out of band while the prefill runs.

On the wire, after the shared-secret handshake (transport.auth), the prefill side sends per request
    KVPageFrame(request_id, layer, block_ids, num_bytes) + num_bytes raw page bytes   (any number)
    KVStreamEnd(request_id, num_bytes)
and the decode side answers KVStreamEnd with KVStreamAck(request_id, bytes written, error). Headers are
ordinary frames (codec type checks, CONTROL_FRAME_BYTES); a payload's size is checked against what its block
ids need and against `max_payload` before a byte of it is read. Anything else closes that connection with
one logged line; the endpoint and the other connections carry on.

Both ends run on plain threads with blocking sockets: `sendmsg` of memoryviews of the tensor storage on one
side, `recv_into` a buffer held per connection on the other, both outside the GIL, so neither actor's event
loop nor its step thread waits on the network.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from transport import auth
from transport.codec import Limits, decode, encode_parts
from transport.errors import AuthenticationError, ConnectionClosed, ProtocolError, TransportError
from transport.framing import (CONTROL_FRAME_BYTES, frame_buffers, recv_exactly_into, recv_frame_body,
                               send_buffers)
from transport import messages as m

log = logging.getLogger("phase_serve.transport")

MAX_PAYLOAD_BYTES = 64 << 20
"""The largest out-of-band payload one frame may announce (a sender splits a layer's blocks to fit)."""
HEADER_LIMITS = Limits(max_bytes=CONTROL_FRAME_BYTES)
CONNECT_TIMEOUT = auth.DEFAULT_HANDSHAKE_TIMEOUT
SOCKET_BUFFER_BYTES = 4 << 20
"""Kernel send and receive buffers of a stream: the defaults halve loopback throughput (0.6 against 1.1 GB/s
for 189 MB in bench.kv_transfer's conditions), since every few hundred KiB the sender then waits for the
receiver's thread to run."""


def _send_message(sock: socket.socket, msg: m.Message, payload: Sequence[memoryview] = ()) -> int:
    return send_buffers(sock, [*frame_buffers(encode_parts(msg, HEADER_LIMITS), HEADER_LIMITS.max_bytes),
                               *payload])


def _recv_message(sock: socket.socket) -> m.Message:
    return decode(recv_frame_body(sock, HEADER_LIMITS.max_bytes), HEADER_LIMITS)


def page_views(pages: torch.Tensor) -> list[memoryview]:
    """Byte views of a tensor's memory, without a copy where it is contiguous and on the CPU."""
    if pages.device.type != "cpu":
        pages = pages.cpu()
    if not pages.is_contiguous():
        pages = pages.contiguous()
    return [memoryview(pages.view(torch.uint8).reshape(-1).numpy())]


# ---- the sending side (prefill actor) ---------------------------------------------------------------------

StreamDone = Callable[[int, str | None, float], None]
"""Called on the sender's thread when a request's stream ends: (bytes the peer wrote, error or None, seconds the
link was busy with the request: writing its frames and waiting for its acknowledgement)."""


@dataclass
class _Request:
    sent: int = 0
    error: str | None = None
    busy: float = 0.0  # seconds spent writing its frames and awaiting its acknowledgement


class KVStreamSender:
    """One kept-open stream to one decode actor. `send_pages` and `end` queue work (any thread, never block);
    a thread connects on first use (again after a failure), writes frames in queue order and waits for each
    request's acknowledgement. A failure fails the requests in flight on that connection, not later ones."""

    def __init__(self, host: str, port: int, secret: bytes, *, name: str = "",
                 max_payload: int = MAX_PAYLOAD_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.host, self.port, self._secret = host, port, auth.check_secret(secret)
        self.max_payload, self._clock = max_payload, clock  # the clock times each request's busy seconds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._sock: socket.socket | None = None
        self._closed = False
        self.bytes_sent = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-stream-{name or port}", daemon=True)
        self._thread.start()

    def send_pages(self, request_id: str, layer: int, block_ids: list[int], pages: torch.Tensor,
                   bytes_per_block: int, ready: Callable[[], None] | None = None) -> None:
        """Queue one layer's pages of `block_ids`, laid out [2, len(block_ids), *page] (`pages` may be a view
        of a pool the caller no longer writes these blocks of; the queue holds it until it is sent). `ready`,
        when given, blocks until `pages` hold their data (a copy off a GPU still running); the thread calls it
        before it reads them."""
        self._queue.put(("pages", request_id, layer, list(block_ids), pages, bytes_per_block, ready))

    def end(self, request_id: str, deadline: float, done: StreamDone) -> None:
        """Queue the request's end; `done` runs once the peer acknowledges (or the stream fails). `deadline`
        is monotonic: the acknowledgement is not waited for past it."""
        self._queue.put(("end", request_id, deadline, done))

    def cancel(self, request_id: str) -> None:
        """Forget the request (its job was aborted or expired, so no `end` follows)."""
        self._queue.put(("cancel", request_id))

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)

    # ---- the thread
    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind = item[0]
            if kind == "cancel":  # what was queued before it still goes out, into blocks still its own
                self._requests.pop(item[1], None)
            elif kind == "pages":
                self._pages(*item[1:])
            else:
                self._end(*item[1:])
        self._disconnect()

    def _pages(self, request_id: str, layer: int, block_ids: list[int], pages: torch.Tensor,
               bytes_per_block: int, ready: Callable[[], None] | None) -> None:
        req = self._requests.setdefault(request_id, _Request())
        if req.error is not None:
            return
        if ready is not None:
            try:
                ready()  # not the link's time: the busy seconds start after it
            except Exception as exc:  # a device error in the copy: this request fails, the link is fine
                req.error = f"copying pages off the device: {type(exc).__name__}: {exc}"
                return
        per_frame = max(1, self.max_payload // max(1, bytes_per_block))
        start = self._clock()
        try:
            sock = self._connected()
            for lo in range(0, len(block_ids), per_frame):  # [2, n, *page]: K and V of each block range
                ids = block_ids[lo:lo + per_frame]
                views = page_views(pages[0, lo:lo + len(ids)]) + page_views(pages[1, lo:lo + len(ids)])
                num_bytes = sum(len(v) for v in views)
                _send_message(sock, m.KVPageFrame(request_id, layer, ids, num_bytes), views)
                req.sent += num_bytes
                self.bytes_sent += num_bytes
        except (OSError, TransportError) as exc:
            self._fail(req, f"sending pages to {self.host}:{self.port}: {exc}")
        req.busy += self._clock() - start

    def _end(self, request_id: str, deadline: float, done: StreamDone) -> None:
        req = self._requests.pop(request_id, _Request())
        start = self._clock()
        if req.error is None:
            try:
                sock = self._connected()
                _send_message(sock, m.KVStreamEnd(request_id, req.sent))
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    ack = _recv_message(sock)
                finally:
                    sock.settimeout(None)
                if not isinstance(ack, m.KVStreamAck) or ack.request_id != request_id:
                    raise ProtocolError(f"expected the acknowledgement of {request_id}, got {type(ack).__name__}")
                error = ack.error if ack.error is not None or ack.num_bytes == req.sent else \
                    f"the peer wrote {ack.num_bytes} of {req.sent} bytes"
                self._call(done, ack.num_bytes, error, req.busy + self._clock() - start)
                return
            except (OSError, TransportError) as exc:  # TimeoutError included: a late ack is no ack
                self._fail(req, f"ending the stream to {self.host}:{self.port}: {exc}")
        self._call(done, 0, req.error, req.busy)

    @staticmethod
    def _call(done: StreamDone, num_bytes: int, error: str | None, seconds: float) -> None:
        try:
            done(num_bytes, error, seconds)
        except Exception:
            log.exception("kv stream: completion callback failed")

    def _fail(self, req: _Request, error: str) -> None:
        """The connection is lost or out of step: every request on it fails; the next one reconnects."""
        log.warning("kv stream: %s", error)
        req.error = error
        for other in self._requests.values():
            other.error = other.error or error
        self._disconnect()

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
                sock.settimeout(CONNECT_TIMEOUT)
                sock.connect((self.host, self.port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                auth.client_handshake_blocking(sock, self._secret)
                sock.settimeout(None)
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# ---- the receiving side (decode actor) --------------------------------------------------------------------

class PageSink(Protocol):
    def page_bytes(self, layer: int, block_ids: list[int]) -> int:
        """Bytes the pages of `block_ids` take in one layer (what a KVPageFrame must announce); ValueError for
        a layer or block outside the pool."""

    def write(self, request_id: str, layer: int, block_ids: list[int], payload: memoryview) -> None:
        """Write one frame's pages into the request's reserved blocks, or drop them (no live reservation)."""

    def finish(self, request_id: str) -> tuple[int, str | None]:
        """The request's stream ended: (bytes written into its blocks, why not all of them, or None)."""


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    buffer: bytearray = field(default_factory=bytearray)


class KVStreamServer:
    """The decode actor's KV endpoint: accepts authenticated connections from prefill actors on a thread and
    serves each on a thread of its own, writing pages through `sink`."""

    def __init__(self, host: str, port: int, secret: bytes, sink: PageSink, *,
                 max_payload: int = MAX_PAYLOAD_BYTES,
                 handshake_timeout: float = auth.DEFAULT_HANDSHAKE_TIMEOUT) -> None:
        self._secret, self._sink = auth.check_secret(secret), sink
        self.max_payload, self._handshake_timeout = max_payload, handshake_timeout
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)  # accepted ones inherit
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._conns: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="kv-endpoint", daemon=True).start()

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            conn = _Conn(sock, f"tcp:{peer[0]}:{peer[1]}")
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-in-{peer[1]}", daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            sock.settimeout(self._handshake_timeout)
            auth.server_handshake_blocking(sock, self._secret)
            sock.settimeout(None)
        except (AuthenticationError, OSError) as exc:
            log.warning("kv endpoint: refused %s: %s", conn.peer, exc or type(exc).__name__)
            sock.close()
            return
        with self._lock:
            self._conns.add(conn)
        try:
            while True:
                self._one(conn, _recv_message(sock))
        except ConnectionClosed:
            pass  # the prefill actor went away; its reservations end by their deadlines
        except ProtocolError as exc:
            log.error("kv endpoint: closing connection %s: %s", conn.peer, exc)
        except OSError as exc:
            log.warning("kv endpoint: connection %s lost: %s", conn.peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            sock.close()

    def _one(self, conn: _Conn, msg: m.Message) -> None:
        if isinstance(msg, m.KVPageFrame):
            try:
                expected = self._sink.page_bytes(msg.layer, msg.block_ids)
            except ValueError as exc:
                raise ProtocolError(f"pages of {msg.request_id}: {exc}") from None
            if msg.num_bytes != expected or msg.num_bytes > self.max_payload:
                raise ProtocolError(f"a frame of {msg.num_bytes} payload bytes for {len(msg.block_ids)} blocks "
                                    f"({expected} expected, at most {self.max_payload})")
            if len(conn.buffer) < msg.num_bytes:
                conn.buffer = bytearray(msg.num_bytes)
            view = memoryview(conn.buffer)[:msg.num_bytes]
            recv_exactly_into(conn.sock, view)
            self._sink.write(msg.request_id, msg.layer, msg.block_ids, view)
        elif isinstance(msg, m.KVStreamEnd):
            written, error = self._sink.finish(msg.request_id)
            _send_message(conn.sock, m.KVStreamAck(msg.request_id, written, error))
        else:
            raise ProtocolError(f"a KV stream does not carry {type(msg).__name__}")
