"""Starting the real server (`python cli.py serve`) as a subprocess for tests, and small HTTP helpers."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
TINY_ENGINE_FLAGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "8", "--threads", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
         timeout: float = 30) -> HttpResult:
    """One plain HTTP request (stdlib only); error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return HttpResult(resp.status, dict(resp.headers), resp.read())
    except urllib.error.HTTPError as err:
        return HttpResult(err.code, dict(err.headers), err.read())


# Deadlines in process tests guard against hangs; they never measure speed. Each is written as the time a quiet
# 2-core machine needs and stretched by this factor, so that a machine with another process busy on one of its
# cores (CI beside other work, a developer's build) still meets it and only a real hang fails.
HANG_GUARD = 5.0


def guarded(seconds: float) -> float:
    """A hang guard of `seconds` on a quiet machine, stretched for a loaded one."""
    return seconds * HANG_GUARD


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Polls until `predicate` holds; False if it still does not after guarded(timeout) seconds."""
    deadline = time.monotonic() + guarded(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs: Any) -> HttpResult:
        return http("GET", self.url + path, **kwargs)

    def post(self, path: str, body: bytes | dict, **kwargs: Any) -> HttpResult:
        return http("POST", self.url + path, body, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_server(log_path: Path, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 120, new_session: bool = False) -> ServerProcess:
    """Runs `cli.py serve ARGS` on a free loopback port and waits until /health answers 200. `new_session`:
    the server leads a process group of its own (its pid is the group id), as a service manager starts it."""
    port = free_port()
    cmd = [sys.executable, "cli.py", "serve", "--port", str(port), "--log-format", "json", *args]
    full_env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=new_session)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    if not wait_until(lambda: _healthy(server), timeout, interval=0.1):
        server.stop(signal.SIGKILL)
        raise RuntimeError(f"the server did not become healthy in {timeout}s; its log:\n{server.log()}")
    return server


def _healthy(server: ServerProcess) -> bool:
    if server.proc.poll() is not None:
        raise RuntimeError(f"the server exited with {server.proc.returncode}; its log:\n{server.log()}")
    try:
        return server.get("/health", timeout=1).status == 200
    except OSError:
        return False


def openai_client(server: ServerProcess):
    """The official client, pointed at `server`, without retries (a failure must show at once)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls on the running loop until `predicate` holds; fails naming `what` after guarded(timeout) seconds."""
    deadline = time.monotonic() + guarded(timeout)
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
