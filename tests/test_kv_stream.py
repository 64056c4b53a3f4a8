"""Direct KV streams (transport.kv_stream): out-of-band framing of memoryviews over real sockets, the sender
and the endpoint in process, and a real decode worker's endpoint against hostile and dying peers."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
import threading
import time

import pytest
import torch

from transport import ConnectionClosed, ProtocolError, serve_tcp
from transport import auth
from transport import messages as m
from transport.codec import encode_parts
from transport.framing import HEADER, frame_buffers, recv_exactly_into, recv_frame_body, send_buffers
from transport.kv_stream import HEADER_LIMITS, KVStreamSender, KVStreamServer, page_views

SECRET = secrets.token_bytes(32)


def _reader(sock: socket.socket, n: int, out: bytearray) -> threading.Thread:
    def run() -> None:
        view = memoryview(out)
        recv_exactly_into(sock, view[:n])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


# ---- framing --------------------------------------------------------------------------------------------

def test_send_buffers_writes_memoryviews_of_tensors_in_order_through_partial_sends():
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # forces many partial sendmsg calls
    pages = torch.arange(2 * 5 * 4096, dtype=torch.int32).view(2, 5, 4096)
    views = page_views(pages[0, 1:4]) + page_views(pages[1, 1:4])  # K then V of blocks 1..3, no copy
    assert all(isinstance(v, memoryview) for v in views)
    expected = pages[:, 1:4].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    out = bytearray(len(expected))
    reader = _reader(b, len(expected), out)
    assert send_buffers(a, [b"", *views]) == len(expected)
    reader.join(10)
    assert bytes(out) == expected
    a.close(), b.close()


def test_page_views_share_the_tensor_memory():
    pages = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    (view,) = page_views(pages[0])
    pages[0, 0, 0] = 1.0
    assert bytes(view[:2]) == torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_a_frame_header_is_checked_before_its_body_is_read():
    a, b = socket.socketpair()
    a.sendall(HEADER.pack(HEADER_LIMITS.max_bytes + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        recv_frame_body(b, HEADER_LIMITS.max_bytes)
    a.close()
    with pytest.raises(ConnectionClosed):
        recv_frame_body(b, HEADER_LIMITS.max_bytes)
    b.close()


def test_header_and_out_of_band_payload_round_trip():
    a, b = socket.socketpair()
    payload = bytearray(os.urandom(10_000))
    msg = m.KVPageFrame("r", 1, [3, 4], len(payload))
    send_buffers(a, [*frame_buffers(encode_parts(msg, HEADER_LIMITS), HEADER_LIMITS.max_bytes),
                     memoryview(payload)])
    from transport.codec import decode
    assert decode(recv_frame_body(b, HEADER_LIMITS.max_bytes), HEADER_LIMITS) == msg
    got = bytearray(len(payload))
    recv_exactly_into(b, memoryview(got))
    assert got == payload
    a.close(), b.close()


# ---- sender and endpoint in process ---------------------------------------------------------------------

class Sink:
    """A PageSink over a plain tensor pool [L, 2, N, page] that holds reservations by request id."""

    def __init__(self, layers: int = 2, blocks: int = 16, page: int = 64) -> None:
        self.pool = torch.zeros(layers, 2, blocks, page, dtype=torch.uint8)
        self.reserved: dict[str, set[int]] = {}
        self.written: dict[str, int] = {}

    def page_bytes(self, layer: int, block_ids: list[int]) -> int:
        if not 0 <= layer < self.pool.shape[0] or any(not 0 <= b < self.pool.shape[2] for b in block_ids):
            raise ValueError("outside the pool")
        return len(block_ids) * 2 * self.pool.shape[3]

    def write(self, request_id, layer, block_ids, payload) -> None:
        if not self.reserved.get(request_id, set()).issuperset(block_ids):
            return
        pages = torch.frombuffer(payload, dtype=torch.uint8).view(2, len(block_ids), -1)
        self.pool[layer][:, block_ids] = pages
        self.written[request_id] = self.written.get(request_id, 0) + len(payload)

    def finish(self, request_id):
        if request_id not in self.reserved:
            return 0, "no live reservation"
        return self.written.get(request_id, 0), None


def _stream(sender: KVStreamSender, rid: str, source: torch.Tensor, src_blocks: slice, dest: list[int],
            seconds: list[float] | None = None):
    done = threading.Event()
    result = []
    for layer in range(source.shape[0]):
        sender.send_pages(rid, layer, dest, source[layer, :, src_blocks], 2 * source.shape[3])
    sender.end(rid, time.monotonic() + 10, lambda n, err, busy: (result.append((n, err)), seconds is not None
                                                                 and seconds.append(busy), done.set()))
    assert done.wait(10)
    return result[0]


class TickClock:
    """A clock that advances one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_busy_seconds_cover_each_layer_write_and_the_acknowledgement():
    sink = Sink()
    server = KVStreamServer("127.0.0.1", 0, SECRET, sink)
    sender = KVStreamSender(*server.address, SECRET, clock=TickClock())
    try:
        source = torch.randint(0, 255, (2, 2, 8, 64), dtype=torch.uint8)  # 2 layers
        sink.reserved["a"] = {0, 1}
        seconds: list[float] = []
        assert _stream(sender, "a", source, slice(0, 2), [0, 1], seconds) == (2 * 2 * 128, None)
        assert seconds == [3.0]  # one tick around each layer's writes, one around end + ack
    finally:
        sender.close()
        server.close()


def test_pages_land_in_the_reserved_blocks_and_the_ack_counts_them():
    sink = Sink()
    server = KVStreamServer("127.0.0.1", 0, SECRET, sink)
    sender = KVStreamSender(*server.address, SECRET, max_payload=256)  # 2 blocks a frame: several frames
    try:
        source = torch.randint(0, 255, (2, 2, 8, 64), dtype=torch.uint8)
        sink.reserved["a"] = {5, 6, 7, 9, 11}
        assert _stream(sender, "a", source, slice(2, 7), [5, 6, 7, 9, 11]) == (2 * 5 * 128, None)
        assert torch.equal(sink.pool[:, :, [5, 6, 7, 9, 11]], source[:, :, 2:7])
        # the same connection, kept open, carries the next request
        sink.reserved["b"] = {0}
        assert _stream(sender, "b", source, slice(0, 1), [0]) == (2 * 128, None)
        assert server.num_connections == 1
        # pages for a reservation the endpoint does not hold: acknowledged with an error, nothing written
        before = sink.pool.clone()
        n, err = _stream(sender, "gone", source, slice(0, 1), [1])
        assert n == 0 and "no live reservation" in err and torch.equal(sink.pool, before)
    finally:
        sender.close()
        server.close()


def test_pages_are_read_only_once_their_copy_is_ready_and_a_failed_copy_fails_that_request():
    """`ready` stands for a copy off a GPU still running: the sender's thread waits for it before it reads the
    pages, and a copy that fails fails its request only."""
    sink = Sink()
    server = KVStreamServer("127.0.0.1", 0, SECRET, sink)
    sender = KVStreamSender(*server.address, SECRET)
    try:
        source = torch.randint(1, 255, (1, 2, 2, 64), dtype=torch.uint8)
        host = torch.zeros_like(source[0])  # what the copy will have written once it is ready
        sink.reserved["a"] = {3, 4}
        done = threading.Event()
        result = []
        sender.send_pages("a", 0, [3, 4], host, 128, ready=lambda: host.copy_(source[0]))
        sender.end("a", time.monotonic() + 10, lambda n, err, busy: (result.append((n, err)), done.set()))
        assert done.wait(10) and result == [(2 * 2 * 64, None)]
        assert torch.equal(sink.pool[0][:, [3, 4]], source[0])

        def failed_copy() -> None:
            raise RuntimeError("an illegal memory access")
        sink.reserved["b"] = {5}
        before = sink.pool.clone()
        done.clear()
        sender.send_pages("b", 0, [5], source[0, :, :1], 128, ready=failed_copy)
        sender.end("b", time.monotonic() + 10, lambda n, err, busy: (result.append((n, err)), done.set()))
        assert done.wait(10)
        n, err = result[-1]
        assert n == 0 and "copying pages off the device" in err and "illegal memory access" in err
        assert torch.equal(sink.pool, before)
        sink.reserved["c"] = {6}  # the link itself is fine
        assert _stream(sender, "c", source, slice(0, 1), [6]) == (128, None)
    finally:
        sender.close()
        server.close()


def _raw_client(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    auth.client_handshake_blocking(sock, SECRET)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("frame", ["garbage", "oversized", "mismatched", "foreign_message"])
def test_a_bad_frame_closes_that_connection_only(frame, caplog):
    sink = Sink()
    sink.reserved["a"] = {0, 1}
    server = KVStreamServer("127.0.0.1", 0, SECRET, sink, max_payload=256)
    try:
        bad = _raw_client(server.address)
        with caplog.at_level(logging.WARNING, logger="phase_serve.transport"):
            if frame == "garbage":
                bad.sendall(HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
            elif frame == "oversized":  # 3 blocks of 128 bytes: over max_payload; no payload byte is read
                send_buffers(bad, frame_buffers(encode_parts(m.KVPageFrame("a", 0, [0, 1, 1], 384)), 1 << 20))
            elif frame == "mismatched":
                send_buffers(bad, frame_buffers(encode_parts(m.KVPageFrame("a", 0, [0], 100)), 1 << 20))
            else:
                send_buffers(bad, frame_buffers(encode_parts(m.Heartbeat(1, 0.0)), 1 << 20))
            assert _closed_by_peer(bad)
        assert any(r.levelno == logging.ERROR and "closing connection" in r.getMessage() for r in caplog.records)
        bad.close()
        sender = KVStreamSender(*server.address, SECRET)
        try:  # the endpoint still serves a well-behaved peer
            source = torch.ones(2, 2, 2, 64, dtype=torch.uint8)
            assert _stream(sender, "a", source, slice(0, 2), [0, 1]) == (2 * 2 * 128, None)
        finally:
            sender.close()
    finally:
        server.close()


def test_a_wrong_secret_is_refused_before_any_frame():
    server = KVStreamServer("127.0.0.1", 0, SECRET, Sink())
    try:
        sock = socket.create_connection(server.address, timeout=5)
        with pytest.raises(auth.AuthenticationError):
            auth.client_handshake_blocking(sock, secrets.token_bytes(32))
        sock.close()
    finally:
        server.close()


def test_a_dead_endpoint_fails_the_request_and_the_next_one_reconnects():
    sink = Sink()
    sink.reserved["a"] = {0}
    server = KVStreamServer("127.0.0.1", 0, SECRET, sink)
    address = server.address
    sender = KVStreamSender(*address, SECRET)
    try:
        source = torch.ones(2, 2, 1, 64, dtype=torch.uint8)
        assert _stream(sender, "a", source, slice(0, 1), [0])[1] is None
        server.close()
        n, err = _stream(sender, "b", source, slice(0, 1), [0])
        assert n == 0 and err is not None
    finally:
        sender.close()


# ---- a real decode worker's endpoint --------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_peer_dying_mid_stream_leaves_the_reservation_to_its_deadline(tiny_model_dir):
    """A fake server takes a decode worker's join; a peer sends half a frame of pages into a reservation and
    dies. The worker logs nothing fatal, keeps serving, and the reservation goes by its deadline: no block or
    reservation is left (the worker's own integrity check). Hostile frames on its endpoint close only that
    connection."""
    joined: asyncio.Queue = asyncio.Queue()
    secret = secrets.token_hex(16).encode()

    async def accept(conn) -> None:
        await joined.put(conn)
        await asyncio.sleep(3600)

    server = await serve_tcp("127.0.0.1", 0, secret, accept)
    host, port = server.address
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "cli.py", "worker", "--role", "decode", "--connect", f"{host}:{port}", "--actor-id",
        "remote-decode-x", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "64",
        "--block-size", "8", "--threads", "1", env={**os.environ, "PHASE_SERVE_SECRET": secret.decode()},
        stderr=asyncio.subprocess.PIPE)
    try:
        conn = await asyncio.wait_for(joined.get(), 60)
        hello, ready = await conn.recv(timeout=30), await conn.recv(timeout=30)
        while isinstance(ready, m.StartupProgress):  # the worker joins while it loads, and says how far it is
            ready = await conn.recv(timeout=30)
        assert isinstance(hello, m.Hello) and ready.kv_export["kind"] == "tcp"
        endpoint = (ready.kv_export["host"], ready.kv_export["port"])
        layers = 2
        per_block = int(ready.kv_export["bytes_per_token"] * ready.block_size) // layers

        await conn.send(m.ReserveBlocks("r1", list(range(40)), time.time() + 2.5))
        reserved = await conn.recv(timeout=10)
        assert isinstance(reserved, m.BlocksReserved) and len(reserved.block_ids) == 5

        def die_mid_stream() -> None:
            sock = socket.create_connection(endpoint, timeout=5)
            auth.client_handshake_blocking(sock, secret)
            ids = reserved.block_ids
            header = frame_buffers(encode_parts(m.KVPageFrame("r1", 0, ids, len(ids) * per_block)), 1 << 20)
            send_buffers(sock, [*header, bytes(len(ids) * per_block // 2)])
            sock.close()

        await asyncio.to_thread(die_mid_stream)

        def hostile() -> bool:
            sock = socket.create_connection(endpoint, timeout=5)
            auth.client_handshake_blocking(sock, secret)
            send_buffers(sock, frame_buffers(encode_parts(m.KVPageFrame("r1", 0, [0], 1 << 40)), 1 << 20))
            closed = _closed_by_peer(sock)
            sock.close()
            return closed

        assert await asyncio.to_thread(hostile)
        await asyncio.sleep(3.0)  # past the reservation's deadline and a sweep
        await conn.send(m.CheckIntegrity())
        while not isinstance(report := await conn.recv(timeout=10), m.IntegrityReport):
            pass
        assert report.error is None and (report.used_blocks, report.reservations) == (0, 0), report
        await conn.send(m.Heartbeat(7, time.time()))
        while not isinstance(ack := await conn.recv(timeout=10), m.HeartbeatAck):
            pass
        assert ack.seq == 7
        await conn.send(m.Shutdown())
        conn.close()  # as the server does after Shutdown: the worker then stops instead of rejoining
        _, err = await asyncio.wait_for(worker.communicate(), 20)
        log_text = err.decode()
        assert "kv endpoint: closing connection" in log_text
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
        await server.close()
