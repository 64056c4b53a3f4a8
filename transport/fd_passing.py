"""Hand an open file descriptor to other local processes over a Unix socket (SCM_RIGHTS).

A decode actor's shared KV pool is a /dev/shm file unlinked as soon as it is created, so nothing is left behind
however its processes end. Peers that map it later (a prefill actor, also one restarted long after) get the
descriptor itself from this socket. It lives in the supervisor's 0700 directory, and the server also checks
that each peer runs as this user before it sends anything.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from pathlib import Path

log = logging.getLogger("transport")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FdServer:
    """Serves one descriptor: every accepted connection of this user gets a duplicate, then is closed."""

    def __init__(self, path: str | os.PathLike[str], fd: int) -> None:
        self.path = Path(path)
        self.path.unlink(missing_ok=True)
        self._fd = fd
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, name=f"fd-server-{self.path.name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                    if uid != os.getuid():
                        log.warning("refusing descriptor %s to pid %d of uid %d", self.path.name, pid, uid)
                        continue
                    socket.send_fds(conn, [b"F"], [self._fd])
                except OSError as exc:
                    log.warning("could not hand out %s: %s", self.path.name, exc)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() above
        except OSError:
            pass
        self._sock.close()
        self.path.unlink(missing_ok=True)


def receive_fd(path: str | os.PathLike[str], timeout: float = 10.0) -> int:
    """A descriptor from the FdServer at `path`; the caller owns (and closes) it. OSError if none comes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise OSError(f"{path} sent no descriptor")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]
