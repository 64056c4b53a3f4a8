"""Listeners: `serve_unix` (a socket in a private 0700 directory) and `serve_tcp` (shared-secret handshake).

Each accepted connection runs `handler(connection)` in its own task. Whatever goes wrong on one connection
(bad frame, failed handshake, handler exception) closes that connection and logs one line; the listener and
the other connections carry on.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl as ssl_module
import stat
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from transport import auth
from transport.connection import Connection
from transport.errors import AuthenticationError, ConnectionClosed, ProtocolError
from transport.framing import MAX_FRAME_BYTES, STREAM_BUFFER_LIMIT

Handler = Callable[[Connection], Awaitable[None]]

SOCKET_NAME = "actor.sock"
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes with the terminating NUL

log = logging.getLogger("phase_serve.transport")


class TransportServer:
    """A running listener. `address` is the socket path (Unix) or `(host, port)` (TCP)."""

    def __init__(self, handler: Handler, *, max_frame: int, secret: bytes | None = None,
                 handshake_timeout: float = auth.DEFAULT_HANDSHAKE_TIMEOUT,
                 cleanup: Callable[[], None] | None = None) -> None:
        self._handler, self._max_frame = handler, max_frame
        self._secret, self._handshake_timeout = secret, handshake_timeout
        self._cleanup = cleanup
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.address: str | tuple[str, int] = ""

    @property
    def num_connections(self) -> int:
        return len(self._tasks)

    def _attach(self, server: asyncio.Server, address: str | tuple[str, int]) -> None:
        self._server, self.address = server, address

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if await self._authenticate(reader, writer):
                await self._serve(Connection(reader, writer, max_frame=self._max_frame))
        except asyncio.CancelledError:
            pass  # close() cancelled us; asyncio's stream callback (3.11) would log a cancelled task as an error
        finally:
            self._tasks.discard(task)

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if self._secret is None:
            return True
        try:
            async with asyncio.timeout(self._handshake_timeout):
                await auth.server_handshake(reader, writer, self._secret)
            return True
        except (AuthenticationError, TimeoutError, OSError) as exc:
            log.warning("transport: refused %s: %s", writer.get_extra_info("peername"), _describe(exc))
            writer.transport.abort()
            return False

    async def _serve(self, conn: Connection) -> None:
        try:
            await self._handler(conn)
        except (ConnectionClosed, ProtocolError):
            pass  # the peer left, or the Connection already logged the bad frame
        except Exception:
            log.exception("transport: handler failed on %s; closing that connection", conn.peer)
        finally:
            conn.close()

    async def close(self) -> None:
        """Stops listening, cancels the handlers of live connections, removes the socket (and its private
        directory, when `serve_unix` created it)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None

    async def __aenter__(self) -> TransportServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _describe(exc: BaseException) -> str:
    return str(exc) if str(exc) else type(exc).__name__


# ---- Unix-domain sockets --------------------------------------------------------------------------------

def private_socket_dir(prefix: str = "phase-serve-") -> Path:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def _check_private_dir(directory: Path) -> None:
    info = directory.stat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{directory} must be a directory owned by this user with mode 0700")


def _prepare_unix_path(path: str | os.PathLike[str] | None) -> tuple[Path, Path | None]:
    """The socket path, and the directory we created for it (removed again on close), if any."""
    if path is None:
        directory = private_socket_dir()
        return directory / SOCKET_NAME, directory
    sock = Path(path)
    created = None
    if not sock.parent.exists():
        sock.parent.mkdir(mode=0o700)
        sock.parent.chmod(0o700)  # mkdir's mode is filtered by the umask; make sure it is exactly 0700
        created = sock.parent
    _check_private_dir(sock.parent)
    _remove_stale_socket(sock)
    return sock, created


def _remove_stale_socket(sock: Path) -> None:
    if sock.is_socket():
        sock.unlink()  # left by a dead predecessor; the directory is ours, so the socket is too
    elif sock.exists():
        raise FileExistsError(f"{sock} exists and is not a socket")


def _unix_cleanup(sock: Path, directory: Path | None) -> Callable[[], None]:
    def cleanup() -> None:
        sock.unlink(missing_ok=True)
        if directory is not None:
            try:
                directory.rmdir()
            except OSError:
                pass  # someone put something else there; leave it
    return cleanup


async def serve_unix(path: str | os.PathLike[str] | None, handler: Handler, *,
                     max_frame: int = MAX_FRAME_BYTES) -> TransportServer:
    """Listens on a Unix socket. `path=None` creates a private directory (0700) and listens on
    `<dir>/actor.sock`; an explicit path's parent must be private (it is created 0700 if missing). The socket
    file is 0600. The filesystem permissions are the access control: no handshake."""
    sock, directory = _prepare_unix_path(path)
    cleanup = _unix_cleanup(sock, directory)
    server = TransportServer(handler, max_frame=max_frame, cleanup=cleanup)
    try:
        if len(os.fsencode(sock)) > _MAX_UNIX_PATH:
            raise ValueError(f"unix socket path is longer than {_MAX_UNIX_PATH} bytes: {sock}")
        listener = await asyncio.start_unix_server(server._on_connect, path=os.fspath(sock),
                                                   limit=STREAM_BUFFER_LIMIT)
        sock.chmod(0o600)  # the 0700 directory already keeps others out; this is belt and braces
    except BaseException:
        cleanup()
        raise
    server._attach(listener, os.fspath(sock))
    return server


# ---- TCP ------------------------------------------------------------------------------------------------

async def serve_tcp(host: str, port: int, secret: bytes, handler: Handler, *, max_frame: int = MAX_FRAME_BYTES,
                    handshake_timeout: float = auth.DEFAULT_HANDSHAKE_TIMEOUT,
                    ssl: ssl_module.SSLContext | None = None) -> TransportServer:
    """Listens on TCP (`port=0` picks a free one: see `.address`). Every connection must pass the shared-secret
    handshake within `handshake_timeout` seconds before `handler` sees it."""
    server = TransportServer(handler, max_frame=max_frame, secret=auth.check_secret(secret),
                             handshake_timeout=handshake_timeout)
    listener = await asyncio.start_server(server._on_connect, host, port, limit=STREAM_BUFFER_LIMIT, ssl=ssl)
    bound = listener.sockets[0].getsockname()
    server._attach(listener, (bound[0], bound[1]))
    return server
