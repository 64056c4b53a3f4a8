"""The server's life as a service manager sees it: what a stop leaves behind (SIGTERM to the process group, SIGKILL
then the next start), a start refused for a small /dev/shm or for memory that does not fit, the last event of a
stream aborted at shutdown, and a request that finds no decode actor up."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest

from tests.server_utils import (REPO, TINY_ENGINE_FLAGS, ServerProcess, guarded, openai_client, start_server,
                                wait_until)
from transport.owned import owned_prefix

SHM = Path("/dev/shm")
TMP = Path(tempfile.gettempdir())
DISAGG = ("--prefill-actors", "1", "--decode-actors", "1", "--disagg", "always")
SMALL_SHM = ("--shm-free-bytes", str(64 << 20))  # what Docker gives a container by default
TINY_POOL = ("--num-kv-blocks", "32768")  # 128 MiB of fp32 KV on the tiny model: more than SMALL_SHM has


def _serve(tmp_path: Path, model: Path, *args: str, **kwargs) -> ServerProcess:
    return start_server(tmp_path / "server.log", "--model", str(model), *TINY_ENGINE_FLAGS, *args, **kwargs)


def _pids(server: ServerProcess) -> set[int]:
    return {server.proc.pid} | {a["pid"] for a in server.get("/status").json()["actors"] if a["pid"]}


def _named_by(directory: Path, kind: str, pids: set[int]) -> list[Path]:
    """Entries of `directory` whose owned name (transport.owned) names one of `pids`."""
    return [p for pid in pids for p in directory.glob(f"{owned_prefix(kind, pid)}*")]


def _shm_maps(pid: int) -> list[str]:
    """The /dev/shm files the process has mapped."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split(None, 5)[5] for line in lines if len(line.split(None, 5)) == 6
                   and line.split(None, 5)[5].startswith(str(SHM))})


def _shm_links(pid: int) -> list[str]:
    """What the process's open descriptors point to in /dev/shm."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(SHM)):
            links.append(target)
    return links


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _log_events(server: ServerProcess) -> list[str]:
    events = []
    for line in server.log().splitlines():
        try:
            events.append(str(json.loads(line).get("event", "")))
        except ValueError:
            events.append(line)
    return events


def test_sigterm_to_the_process_group_leaves_nothing_behind(tiny_model_dir, tmp_path):
    server = _serve(tmp_path, tiny_model_dir, *DISAGG, "--grace-period", "1", new_session=True)
    try:
        out = openai_client(server).completions.create(model=server.get("/v1/models").json()["data"][0]["id"],
                                                       prompt="Hello there", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        pids = _pids(server)
        actors = {a["role"]: a["pid"] for a in server.get("/status").json()["actors"]}
        assert len(pids) == 3
        # The hand-off pool is in /dev/shm and mapped by both actors, yet it has no name there.
        pool = _shm_maps(actors["decode"])
        assert len(pool) == 1 and pool[0].endswith("(deleted)"), pool
        assert _shm_maps(actors["prefill"]) == pool
        assert _named_by(SHM, "kv", pids) == []
        assert len(_named_by(TMP, "actors", {server.proc.pid})) == 1
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
    finally:
        server.stop(signal.SIGKILL)
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 30)
    assert _named_by(SHM, "kv", pids) == []
    assert _named_by(TMP, "actors", {server.proc.pid}) == []


def test_what_sigkill_leaves_is_reclaimed_at_the_next_start(tiny_model_dir, tmp_path):
    (tmp_path / "first").mkdir()
    first = _serve(tmp_path / "first", tiny_model_dir, new_session=True)
    try:
        decode = next(a["pid"] for a in first.get("/status").json()["actors"] if a["role"] == "decode")
        assert _shm_links(decode) == [] and _shm_maps(decode) == []  # no prefill actor: no shared pool at all
        left = _named_by(TMP, "actors", {first.proc.pid})
        assert len(left) == 1
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop(signal.SIGKILL)
    assert wait_until(lambda: not Path(f"/proc/{decode}").exists(), 30)
    assert left[0].is_dir()
    dead, alive = _dead_pid(), os.getpid()
    stale = SHM / f"{owned_prefix('kv', dead)}decode-0-test"
    live = SHM / f"{owned_prefix('kv', alive)}decode-0-test"
    foreign = SHM / f"phase-serve-kv-1-{dead}-decode-0-test"  # another PID namespace's: its pids mean nothing
    for path in (stale, live, foreign):
        path.write_bytes(b"kv")
    (tmp_path / "second").mkdir()
    second = None
    try:
        second = _serve(tmp_path / "second", tiny_model_dir, *SMALL_SHM)  # a default serve needs no segment
        assert not left[0].exists() and not stale.exists()
        assert live.exists() and foreign.exists()
    finally:
        for path in (stale, live, foreign):
            path.unlink(missing_ok=True)
        if second is not None:
            assert second.stop() == 0


def test_a_small_dev_shm_refuses_to_start_with_one_sentence(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "cli.py", "serve", "--port", "0", "--log-format", "json", "--model", str(tiny_model_dir),
           *TINY_ENGINE_FLAGS, *TINY_POOL, *SMALL_SHM, *DISAGG]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, output
    refusal = [json.loads(line) for line in output.splitlines() if '"cannot start"' in line]
    assert len(refusal) == 1, output
    error = refusal[0]["error"]
    assert "/dev/shm has 64 MiB free" in error and "needs 128 MiB" in error, output
    assert "--shm-size=" in error and "--ipc=host" in error
    assert _named_by(TMP, "actors", {proc.pid}) == []  # a failed start leaves no directory


def test_a_start_that_would_not_fit_in_memory_is_refused_before_any_actor_spawns(tiny_model_dir, tmp_path):
    private_tmp = tmp_path / "tmp"  # where the supervisor would make its socket directory
    private_tmp.mkdir()
    cmd = [sys.executable, "cli.py", "serve", "--port", "0", "--log-format", "json", "--model", str(tiny_model_dir),
           "--kv-cache-memory", "100000GiB"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=guarded(60),
                          env=os.environ | {"TMPDIR": str(private_tmp)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    refusal = [e["error"] for e in events if e["event"] == "cannot start"]
    assert len(refusal) == 1, output
    assert re.fullmatch(r"model weights [\d.]+ MiB \(bfloat16\) \+ packed copies [\d.]+ MiB \+ "
                        r"KV pool 100000\.0 GiB \+ activations [\d.]+ MiB = "
                        r"100000\.\d GiB, but only [\d.]+ GiB is available; lower --kv-cache-memory \(or "
                        r"--num-kv-blocks\), or free some memory", refusal[0]), refusal[0]
    resident = [e["event"] for e in events if e["event"].startswith("resident once loaded")]
    assert len(resident) == 1 and resident[0].startswith("resident once loaded by 1 actor on this host: "
                                                         + refusal[0].split(", but")[0]), output
    assert {e["role"] for e in events} == {"server"}, output  # no actor logged a line: none started
    assert list(private_tmp.iterdir()) == []  # nor did the supervisor make its socket directory


def test_a_stream_aborted_at_the_end_of_the_grace_period_gets_a_last_error_event(tiny_model_dir, tmp_path):
    server = _serve(tmp_path, tiny_model_dir, "--grace-period", "0", "--stream-interval", "1")
    try:
        stream = openai_client(server).completions.create(
            model=server.get("/v1/models").json()["data"][0]["id"], prompt="Hello", max_tokens=1000,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices
        server.proc.send_signal(signal.SIGTERM)
        received = 0
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                received += 1
        assert info.value.message == "server shutting down", info.value.body
        assert info.value.body["code"] == "shutting_down"
        assert received < 998  # cut short: an uninterrupted reply has 999 more chunks
        assert server.proc.wait(60) == 0, server.log()
    finally:
        server.stop(signal.SIGKILL)
    events = _log_events(server)
    assert events.index("aborting requests still in flight") < events.index("stopped")


def test_ctrl_c_to_the_process_group_finishes_the_streams_like_sigterm(tiny_model_dir, tmp_path):
    """A terminal's Ctrl-C sends SIGINT to every process of the group, the actors included: they leave the stop to
    the server, which drains the stream within the grace period and then stops them."""
    server = _serve(tmp_path, tiny_model_dir, "--grace-period", "600", "--stream-interval", "1", new_session=True)
    try:
        stream = openai_client(server).completions.create(
            model=server.get("/v1/models").json()["data"][0]["id"], prompt="Hello", max_tokens=300,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        os.killpg(server.proc.pid, signal.SIGINT)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "length" and text  # all 300 tokens (ignore_eos)
        assert server.proc.wait(120) == 0, server.log()  # a hang guard: the stop itself takes seconds
    finally:
        server.stop(signal.SIGKILL)
    events = _log_events(server)
    assert "aborting requests still in flight" not in events
    assert not [e for e in events if "is down" in e], events
    assert events.index("stopped") >= 0


def test_with_no_decode_actor_up_a_request_gets_503_and_retry_after(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    server = _serve(tmp_path, model, "--capacity-timeout", "1")
    try:
        client = openai_client(server)
        name = server.get("/v1/models").json()["data"][0]["id"]
        decode = next(a["pid"] for a in server.get("/status").json()["actors"] if a["role"] == "decode")
        shutil.rmtree(model)  # from now on every restart of the decode actor fails to load the model
        os.kill(decode, signal.SIGKILL)
        assert wait_until(lambda: server.get("/health").status == 503, 30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=name, prompt="Hello", max_tokens=4)
        assert info.value.status_code == 503, info.value.body
        assert info.value.response.headers["Retry-After"] == "5"
        assert info.value.body["code"] == "no_capacity"
        with pytest.raises(openai.APIStatusError) as streamed:
            list(client.completions.create(model=name, prompt="Hello", max_tokens=4, stream=True))
        assert streamed.value.status_code == 503 and "Retry-After" in streamed.value.response.headers
        assert wait_until(lambda: any("failed to start" in e for e in _log_events(server)), 60)
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)
    events = _log_events(server)
    assert f"actor decode-0 (pid {decode}) is down: killed by SIGKILL" in events, events
    assert "restarting actor decode-0 in 0 s, restart 1" in events, events  # the first replacement: at once
    failed = [e for e in events if e.startswith("actor decode-0 failed to start: pid ")]
    assert failed and "exited with status 1 while starting" in failed[0], failed
