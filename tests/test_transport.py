"""Transport: every message through the codec, strict decoding, framing over real sockets, the private Unix
socket directory, and the TCP shared-secret handshake."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import secrets
import socket
import stat
import types
import typing
from typing import Any

import msgpack
import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import (AuthenticationError, Connection, ConnectionClosed, Limits, ProtocolError, connect_tcp,
                       connect_unix, decode, encode, encode_parts, load_secret, serve_tcp, serve_unix,
                       write_secret_file)
from transport import messages as m
from transport.framing import HEADER
from transport.messages import MESSAGE_TYPES, Message, Record

# ---- hypothesis strategies derived from the message annotations -----------------------------------------

TEXT = st.text(max_size=12)
SCALARS: dict[object, st.SearchStrategy[Any]] = {
    int: st.integers(-(2**63), 2**64 - 1),  # msgpack's range
    float: st.floats(allow_nan=False),
    str: TEXT,
    bytes: st.binary(max_size=32),
    bool: st.booleans(),
    type(None): st.none(),
}


def plain(depth: int) -> st.SearchStrategy[Any]:
    leaf = st.one_of(*SCALARS.values())
    if depth == 0:
        return leaf
    inner = plain(depth - 1)
    return st.one_of(leaf, st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3))


def strategy_for(tp: object) -> st.SearchStrategy[Any]:
    if tp in SCALARS:
        return SCALARS[tp]
    if tp is Any:
        return plain(4)
    if isinstance(tp, type) and issubclass(tp, Record):
        return record_strategy(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*(strategy_for(a) for a in args))
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=4)
    assert origin is dict, tp
    return st.dictionaries(TEXT, strategy_for(args[1]), max_size=4)


def record_strategy(cls: type[Record]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


# ---- codec ----------------------------------------------------------------------------------------------

def test_registry_holds_every_message_class_once():
    classes = {v for v in vars(m).values() if isinstance(v, type) and issubclass(v, Message) and v is not Message}
    assert set(MESSAGE_TYPES.values()) == classes
    assert all(MESSAGE_TYPES[cls.TAG] is cls for cls in classes)
    with pytest.raises(TypeError):
        MESSAGE_TYPES["x"] = m.Drain  # type: ignore[index]


@pytest.mark.parametrize("tag", sorted(MESSAGE_TYPES))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_every_message_round_trips(tag, data):
    msg = data.draw(record_strategy(MESSAGE_TYPES[tag]))
    out = decode(encode(msg))
    assert type(out) is type(msg) and out == msg
    assert b"".join(encode_parts(msg)) == encode(msg)


def test_wire_format_is_a_tagged_map_of_positional_fields():
    row = m.TokenUpdate("r1", 0, 42, None, -0.5, [m.TopLogprob(42, -0.5)], 7, 0)
    assert msgpack.unpackb(encode(m.TokenUpdates([row]))) == {
        "t": "token_updates", "f": [[["r1", 0, 42, None, -0.5, [[42, -0.5]], 7, 0, None, None, None]], None]}
    assert msgpack.unpackb(encode(m.Drain())) == {"t": "drain", "f": []}


def test_large_payload_travels_as_its_own_part():
    msg = m.KVPages("r1", 3, [4, 5], random.Random(0).randbytes(3 << 20))
    parts = encode_parts(msg)
    assert len(parts) == 2 and parts[1] is msg.payload
    assert decode(b"".join(parts)) == msg


def _raw(tag: object, fields: object) -> bytes:
    return msgpack.packb({"t": tag, "f": fields}, use_bin_type=True)


def _full(tag: str, fields: list) -> bytes:
    """A raw message with the given leading fields and None for the optional rest, so that only the value
    under test (not the arity) can make it invalid."""
    count = len(dataclasses.fields(MESSAGE_TYPES[tag]))
    return _raw(tag, fields + [None] * (count - len(fields)))


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


BAD_INPUTS = {
    "empty": b"",
    "never-used byte": b"\xc1" * 16,
    "truncated": encode(m.Heartbeat(1, 2.0))[:-3],
    "trailing bytes": encode(m.Drain()) + b"\x00",
    "not a map": msgpack.packb(["heartbeat", [1, 2.0]]),
    "extra envelope key": msgpack.packb({"t": "drain", "f": [], "x": 1}),
    "tag not a str": _raw(7, []),
    "unknown tag": _raw("launch_missiles", []),
    "too few fields": _raw("heartbeat", [1]),
    "too many fields": _raw("heartbeat", [1, 2.0, 3]),
    "bool for int": _raw("heartbeat", [True, 2.0]),
    "float for int": _raw("heartbeat", [1.0, 2.0]),
    "str for float": _raw("heartbeat", [1, "2.0"]),
    "str in token ids": _full("add_request", ["r", [1, "2"], {}, 0, 0.0]),
    "None for a list": _full("add_request", ["r", None, {}, 0, 0.0]),
    "str for bytes": _raw("kv_pages", ["r", 0, [1], "not bytes"]),
    "bytes dict key": _full("ready", ["d0", 1, 16, {b"kind": "shm"}]),
    "short row": _raw("token_updates", [[["r", 0, 1]]]),
    "row not an array": _raw("token_updates", [[{"request_id": "r"}]]),
    "extension type": _full("ready", ["d0", 1, 16, {"x": msgpack.ExtType(5, b"boom")}]),
    "timestamp": _full("ready", ["d0", 1, 16, {"x": msgpack.Timestamp(1)}]),
    "too deep": _full("ready", ["d0", 1, 16, {"x": _nested(8)}]),
    "very deep": _full("ready", ["d0", 1, 16, {"x": _nested(400)}]),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_decode_rejects(name):
    with pytest.raises(ProtocolError) as err:
        decode(BAD_INPUTS[name])
    if name not in ("too few fields", "too many fields", "short row", "row not an array"):
        assert "expected an array of" not in str(err.value), f"{name} failed on arity, not on what it tests"


def test_depth_limit_is_exact():
    assert decode(_full("ready", ["d0", 1, 16, {"x": _nested(7)}])).kv_export["x"] == _nested(7)
    with pytest.raises(ProtocolError, match="nesting"):
        decode(_full("ready", ["d0", 1, 16, {"x": _nested(8)}]))


def test_decode_enforces_size_limits():
    small = Limits(max_bytes=1024, max_array_len=100, max_map_len=4)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(m.KVPages("r", 0, [1], bytes(2000))), small)
    with pytest.raises(ProtocolError):
        decode(encode(m.AddRequest("r", list(range(101)), {})), small)
    with pytest.raises(ProtocolError):
        decode(encode(m.Ready("d0", 1, 16, {str(i): i for i in range(5)})), small)
    with pytest.raises(ProtocolError):
        encode(m.KVPages("r", 0, [1], bytes(2000)), small)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decode_of_random_bytes_only_ever_raises_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@pytest.mark.parametrize("bad", [
    m.Heartbeat(2**64, 1.0),  # beyond msgpack's integer range
    m.Heartbeat(True, 1.0),
    m.AddRequest("r", (1, 2), {}),  # type: ignore[arg-type]  a tuple would come back as a list
    m.Ready("d0", 1, 16, {"shape": (1, 2)}),
    m.Ready("d0", 1, 16, {1: "x"}),  # type: ignore[dict-item]
    m.Ready("d0", 1, 16, {"x": object()}),
    m.TokenUpdates([["r", 0, 1, None, None, None, 0, 0]]),  # type: ignore[list-item]  rows are TokenUpdate
    m.Message(),
    "not a message",
])
def test_encode_rejects(bad):
    with pytest.raises(ProtocolError):
        encode(bad)  # type: ignore[arg-type]


# ---- connections over a socket pair ---------------------------------------------------------------------

@pytest.fixture
async def pair():
    a, b = socket.socketpair()
    left = Connection(*await asyncio.open_unix_connection(sock=a), max_frame=1 << 20)
    right = Connection(*await asyncio.open_unix_connection(sock=b), max_frame=1 << 20)
    yield left, right
    left.close()
    right.close()


@pytest.mark.process
async def test_concurrent_sends_never_interleave(pair):
    left, right = pair
    msgs = [m.KVPages(f"r{i}", i, [i], bytes([i]) * 50_000) for i in range(20)]

    async def receive_all() -> list[Message]:
        return [await right.recv(timeout=5) for _ in msgs]

    *_, received = await asyncio.gather(*(left.send(x) for x in msgs), receive_all())
    assert sorted(received, key=lambda x: x.layer) == msgs


@pytest.mark.process
async def test_recv_timeout_between_frames_keeps_the_connection(pair):
    left, right = pair
    with pytest.raises(TimeoutError):
        await right.recv(timeout=0.05)
    await left.send(m.Heartbeat(1, 0.5))
    assert await right.recv(timeout=2) == m.Heartbeat(1, 0.5)


@pytest.mark.process
async def test_recv_timeout_mid_frame_closes(pair):
    left, right = pair
    left._writer.write(HEADER.pack(100) + b"\x00" * 10)
    with pytest.raises(TimeoutError):
        await right.recv(timeout=0.1)
    assert right.closed
    with pytest.raises(ConnectionClosed):
        await right.recv()


@pytest.mark.process
async def test_oversized_send_raises_and_keeps_the_connection(pair):
    left, right = pair
    with pytest.raises(ProtocolError):
        await left.send(m.KVPages("r", 0, [1], bytes(2 << 20)))
    await left.send(m.Drain())
    assert await right.recv(timeout=2) == m.Drain()


@pytest.mark.process
async def test_oversized_frame_closes_the_receiver(pair, caplog):
    left, right = pair
    left._writer.write(HEADER.pack((1 << 20) + 1))
    with caplog.at_level(logging.WARNING, logger="phase_serve.transport"), pytest.raises(ProtocolError):
        await right.recv(timeout=2)
    assert right.closed and len(caplog.records) == 1 and "exceeds" in caplog.records[0].getMessage()


@pytest.mark.process
async def test_peer_close_ends_iteration_and_send_fails(pair):
    left, right = pair
    await left.send(m.Shutdown())
    await left.aclose()
    assert [msg async for msg in right] == [m.Shutdown()]
    with pytest.raises(ConnectionClosed):
        await left.send(m.Drain())


# ---- Unix-domain server ---------------------------------------------------------------------------------

async def echo(conn: Connection) -> None:
    async for msg in conn:
        await conn.send(msg)


@pytest.fixture
async def unix_server():
    server = await serve_unix(None, echo, max_frame=1 << 20)
    yield server
    await server.close()


async def _round_trip(conn: Connection, msg: Message) -> None:
    await conn.send(msg)
    assert await conn.recv(timeout=5) == msg


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """True once the peer closes (whatever it sent before); False if it is still open after 5 s."""
    try:
        await asyncio.wait_for(reader.read(), timeout=5)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.mark.process
async def test_unix_socket_lives_in_a_private_directory(unix_server):
    path = unix_server.address
    directory = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    await unix_server.close()
    assert not os.path.exists(directory)


@pytest.mark.parametrize("garbage", [
    HEADER.pack(32) + b"\xc1" + random.Random(1).randbytes(31),  # a frame whose body is not msgpack
    HEADER.pack(0xFFFFFFFF),  # a length far over the limit
    HEADER.pack((1 << 20) + 1) + bytes(64),  # just over the limit
    random.Random(2).randbytes(4096),  # noise
    HEADER.pack(len(_raw("nope", []))) + _raw("nope", []),  # well-formed, unknown tag
])
@pytest.mark.process
async def test_bad_client_is_dropped_while_others_keep_working(unix_server, garbage, caplog):
    good = await connect_unix(unix_server.address)
    await _round_trip(good, m.Heartbeat(1, 1.0))
    reader, writer = await asyncio.open_unix_connection(unix_server.address)
    with caplog.at_level(logging.WARNING, logger="phase_serve.transport"):
        writer.write(garbage)
        writer.write_eof()
        assert await _closed_by_peer(reader)
    await _round_trip(good, m.Heartbeat(2, 2.0))
    late = await connect_unix(unix_server.address)
    await _round_trip(late, m.AddRequest("r", [1, 2, 3], {"temperature": 0.0}))
    assert len([r for r in caplog.records if r.name == "phase_serve.transport"]) == 1
    writer.close()
    await good.aclose()
    await late.aclose()


@pytest.mark.process
async def test_a_failing_handler_closes_only_its_connection(caplog):
    async def handler(conn: Connection) -> None:
        msg = await conn.recv()
        if isinstance(msg, m.Error):
            raise RuntimeError("handler bug")
        await echo_first(conn, msg)

    async def echo_first(conn: Connection, msg: Message) -> None:
        await conn.send(msg)
        await echo(conn)

    async with await serve_unix(None, handler) as server:
        bad = await connect_unix(server.address)
        with caplog.at_level(logging.ERROR, logger="phase_serve.transport"):
            await bad.send(m.Error("boom"))
            with pytest.raises(ConnectionClosed):
                await bad.recv(timeout=5)
        assert any("handler failed" in r.getMessage() for r in caplog.records)
        good = await connect_unix(server.address)
        await _round_trip(good, m.Drain())
        await good.aclose()


@pytest.mark.process
async def test_explicit_path_needs_a_private_parent(tmp_path):
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    with pytest.raises(PermissionError):
        await serve_unix(public / "a.sock", echo)
    server = await serve_unix(tmp_path / "private" / "a.sock", echo)
    assert stat.S_IMODE(os.stat(tmp_path / "private").st_mode) == 0o700
    await server.close()
    assert not (tmp_path / "private").exists()


@pytest.mark.process
async def test_close_cancels_live_handlers(unix_server, caplog):
    conn = await connect_unix(unix_server.address)
    await _round_trip(conn, m.Drain())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await asyncio.wait_for(unix_server.close(), timeout=5)
        await asyncio.sleep(0.01)
    assert unix_server.num_connections == 0
    assert not [r for r in caplog.records if r.name == "asyncio"]  # no "Exception in callback" noise
    with pytest.raises(ConnectionClosed):
        await conn.recv(timeout=5)


@pytest.mark.process
def test_unix_round_trip_on_uvloop():
    async def main() -> None:
        async with await serve_unix(None, echo) as server:
            async with await connect_unix(server.address) as conn:
                await _round_trip(conn, m.KVPages("r", 1, [2], bytes(3 << 20)))
    uvloop.run(main())


# ---- TCP with a shared secret ---------------------------------------------------------------------------

SECRET = secrets.token_hex(16).encode()


@pytest.fixture
async def tcp_server():
    seen: list[Message] = []

    async def handler(conn: Connection) -> None:
        async for msg in conn:
            seen.append(msg)
            await conn.send(msg)

    server = await serve_tcp("127.0.0.1", 0, SECRET, handler, handshake_timeout=0.3)
    server.seen = seen  # type: ignore[attr-defined]
    yield server
    await server.close()


@pytest.mark.process
async def test_tcp_with_the_right_secret(tcp_server):
    host, port = tcp_server.address
    async with await connect_tcp(host, port, SECRET) as conn:
        await _round_trip(conn, m.KVPages("r", 0, [1, 2], os.urandom(2 << 20)))


@pytest.mark.process
async def test_tcp_with_a_wrong_secret_is_refused(tcp_server):
    host, port = tcp_server.address
    with pytest.raises(AuthenticationError):
        await connect_tcp(host, port, b"x" * 32)
    assert tcp_server.seen == [] and tcp_server.num_connections == 0
    async with await connect_tcp(host, port, SECRET) as conn:
        await _round_trip(conn, m.Drain())


@pytest.mark.process
async def test_tcp_frames_without_a_handshake_never_reach_the_handler(tcp_server):
    host, port = tcp_server.address
    reader, writer = await asyncio.open_connection(host, port)
    frame = encode(m.Shutdown())
    writer.write(HEADER.pack(len(frame)) + frame + bytes(64))
    assert await _closed_by_peer(reader)
    writer.close()
    assert tcp_server.seen == []


@pytest.mark.process
async def test_a_stalled_handshake_times_out(tcp_server):
    host, port = tcp_server.address
    reader, writer = await asyncio.open_connection(host, port)  # and say nothing
    assert await _closed_by_peer(reader)
    writer.close()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # says nothing until the client gives up
        writer.close()

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    with pytest.raises(TimeoutError):
        await connect_tcp("127.0.0.1", mute.sockets[0].getsockname()[1], SECRET, timeout=0.2)
    mute.close()
    await mute.wait_closed()


def test_load_secret(tmp_path, caplog):
    assert load_secret(environ={"PHASE_SERVE_SECRET": " s" * 10 + "\n"}) == (" s" * 10).strip().encode()
    secret = write_secret_file(tmp_path / "secret")
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert load_secret(tmp_path / "secret", environ={"PHASE_SERVE_SECRET": "other-secret-value!"}) == secret
    for env in ({}, {"PHASE_SERVE_SECRET": "short"}):
        with pytest.raises(ValueError):
            load_secret(environ=env)
