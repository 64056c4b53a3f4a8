"""Shared-secret mutual authentication for TCP connections, and loading the secret.

Handshake (raw bytes, before any frame; the caller bounds it with a timeout):
    server -> client   MAGIC (6 bytes) || server_nonce (32 random bytes)
    client -> server   client_nonce (32) || HMAC-SHA256(secret, "client" || server_nonce || client_nonce)
    server -> client   HMAC-SHA256(secret, "server" || server_nonce || client_nonce)
Each side compares with `hmac.compare_digest`; a mismatch closes the connection before any message is read.
Fresh nonces on both sides defeat replay, and the distinct labels stop a proof being reflected back.
This authenticates the peers; it does not encrypt or sign later frames: across untrusted networks pass an
`ssl.SSLContext` to `serve_tcp` / `connect_tcp` (or tunnel).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import Mapping
from pathlib import Path

from transport.errors import AuthenticationError, ConnectionClosed
from transport.framing import read_exactly, recv_exactly_into

MAGIC = b"PHSV\x00\x01"  # "phase-serve", handshake version 1
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
SECRET_ENV = "PHASE_SERVE_SECRET"
MIN_SECRET_BYTES = 16
DEFAULT_HANDSHAKE_TIMEOUT = 5.0

log = logging.getLogger("phase_serve.transport")


def _proof(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> None:
    """Proves the client knows `secret`, then proves it ourselves; AuthenticationError otherwise."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    writer.write(MAGIC + server_nonce)
    await writer.drain()
    reply = await _read_or_fail(reader, NONCE_BYTES + PROOF_BYTES, "client")
    client_nonce, client_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(client_proof, _proof(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("the client's proof does not match: wrong secret")
    writer.write(_proof(secret, b"server", server_nonce, client_nonce))
    await writer.drain()


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> None:
    challenge = await _read_or_fail(reader, len(MAGIC) + NONCE_BYTES, "server")
    if challenge[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("the server does not speak this handshake (wrong port or version?)")
    server_nonce, client_nonce = challenge[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    writer.write(client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
    await writer.drain()
    server_proof = await _read_or_fail(reader, PROOF_BYTES, "server")
    if not hmac.compare_digest(server_proof, _proof(secret, b"server", server_nonce, client_nonce)):
        raise AuthenticationError("the server's proof does not match: wrong secret")


async def _read_or_fail(reader: asyncio.StreamReader, n: int, peer: str) -> bytes:
    try:
        return await read_exactly(reader, n)
    except ConnectionClosed as exc:
        raise AuthenticationError(f"the {peer} hung up during the handshake (wrong secret?): {exc}") from None


def check_secret(secret: bytes) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def load_secret(path: str | os.PathLike[str] | None = None, *, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret: the contents of `path` if given, else `$PHASE_SERVE_SECRET`; surrounding whitespace
    is stripped. ValueError if neither is set or the secret is shorter than MIN_SECRET_BYTES."""
    env = os.environ if environ is None else environ
    if path is not None:
        return check_secret(_read_secret_file(Path(path)))
    if env.get(SECRET_ENV, "").strip():
        return check_secret(env[SECRET_ENV].strip().encode())
    raise ValueError(f"no shared secret: pass a secret file or set {SECRET_ENV}")


def _read_secret_file(path: Path) -> bytes:
    if path.stat().st_mode & 0o077:
        log.warning("secret file %s is readable by other users; chmod 600 it", path)
    return path.read_bytes().strip()


def write_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Creates `path` (mode 0600, must not exist) holding a fresh random secret; returns the secret."""
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret


def server_handshake_blocking(sock: socket.socket, secret: bytes) -> None:
    """`server_handshake` on a blocking socket (the caller sets its timeout)."""
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    reply = _recv_or_fail(sock, NONCE_BYTES + PROOF_BYTES, "client")
    client_nonce, client_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(client_proof, _proof(secret, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("the client's proof does not match: wrong secret")
    sock.sendall(_proof(secret, b"server", server_nonce, client_nonce))


def client_handshake_blocking(sock: socket.socket, secret: bytes) -> None:
    """`client_handshake` on a blocking socket (the caller sets its timeout)."""
    challenge = _recv_or_fail(sock, len(MAGIC) + NONCE_BYTES, "server")
    if challenge[:len(MAGIC)] != MAGIC:
        raise AuthenticationError("the server does not speak this handshake (wrong port or version?)")
    server_nonce, client_nonce = challenge[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(secret, b"client", server_nonce, client_nonce))
    server_proof = _recv_or_fail(sock, PROOF_BYTES, "server")
    if not hmac.compare_digest(server_proof, _proof(secret, b"server", server_nonce, client_nonce)):
        raise AuthenticationError("the server's proof does not match: wrong secret")


def _recv_or_fail(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray(n)
    try:
        recv_exactly_into(sock, memoryview(buf))
    except ConnectionClosed as exc:
        raise AuthenticationError(f"the {peer} hung up during the handshake (wrong secret?): {exc}") from None
    return bytes(buf)
