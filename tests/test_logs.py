"""One log stream: `serve --log-format json` with a decode actor writes nothing but JSON lines, each naming its
process (actor lines their actor, role and pid), request lines their request id, 4xx access lines the error's
code and param; calibration is logged rounded and a falling curve is flagged and left out of the cost model;
the kernel build line needs a build."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import sys
import threading

import pytest

from actors import logs
from engine.core.calibration import Calibration, log_calibration, monotonic_points
from engine.kernels import extension_build as build
from router.cost_model import DecodeCost, PrefillCost
from tests.server_utils import TINY_ENGINE_FLAGS, start_server, wait_until

MODEL = "tiny-logs"


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """A served request, a 400, an actor killed and restarted, a clean stop: the whole log, parsed."""
    proc = start_server(tmp_path_factory.mktemp("logs") / "server.log", "--model", str(tiny_model_dir),
                        *TINY_ENGINE_FLAGS, "--served-model-name", MODEL, "--decode-actors", "1",
                        "--log-level", "debug", "--recalibrate")  # a first start measures, whatever ran before
    try:
        ok = proc.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        bad = proc.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": "four"})
        old_pid = _actor_pids(proc)[0]
        os.kill(old_pid, signal.SIGKILL)
        assert wait_until(lambda: _actor_pids(proc) not in ([], [old_pid]), timeout=120, interval=0.2)
    finally:
        status = proc.stop()
    return {"ok": ok, "bad": bad, "status": status, "old_pid": old_pid, "text": proc.log()}


def _actor_pids(proc) -> list[int]:
    actors = proc.get("/status").json()["actors"]
    return [a["pid"] for a in actors if a["state"] == "ready"]


def _lines(run) -> list[dict]:
    return [json.loads(line) for line in run["text"].splitlines()]


def test_every_line_is_json(run):
    assert run["status"] == 0 and run["ok"].status == 200 and run["bad"].status == 400
    for line in run["text"].splitlines():
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            pytest.fail(f"a log line is not a JSON object: {line!r}")


def test_every_line_names_its_process(run):
    lines = _lines(run)
    assert all(isinstance(e.get("pid"), int) and e.get("role") and e.get("level") for e in lines)
    actor_lines = [e for e in lines if e["role"] == "decode"]
    assert actor_lines and all(e["actor"] == "decode-0" and e["pid"] != os.getpid() for e in actor_lines)
    assert {e["pid"] for e in actor_lines} >= {run["old_pid"]}
    assert len({e["pid"] for e in actor_lines}) == 2  # the killed actor and its replacement
    server_pids = {e["pid"] for e in lines if e["role"] == "server"}
    assert len(server_pids) == 1 and not server_pids & {e["pid"] for e in actor_lines}


def test_the_start_up_line_is_json_and_still_matches(run):
    serving = [e for e in _lines(run) if e["event"].startswith("serving ")]
    assert len(serving) == 1 and serving[0]["model"] == MODEL
    found = re.search(r"serving .* on (http://\S+)", serving[0]["event"])  # what bench/serve_latency.py reads
    assert found and found.group(1) == serving[0]["url"]


def test_access_lines_carry_the_request_id_and_a_400_says_why(run):
    access = [e for e in _lines(run) if e["event"] == "access" and e["path"] == "/v1/completions"]
    ok = next(e for e in access if e["status"] == 200)
    bad = next(e for e in access if e["status"] == 400)
    assert ok["request_id"] == run["ok"].headers["X-Request-Id"] and "code" not in ok
    assert bad["request_id"] == run["bad"].headers["X-Request-Id"]
    error = run["bad"].json()["error"]
    assert (bad["code"], bad["param"]) == (error["code"], error["param"]) and bad["param"] == "max_tokens"


def test_actor_death_and_calibration_are_logged_as_json(run):
    lines = _lines(run)
    assert any(e["role"] == "server" and e["level"] == "error" and "decode-0" in e["event"] for e in lines)
    calibrated = [e for e in lines if e["role"] == "decode" and e["event"].startswith("calibrated")]
    assert len(calibrated) == 1  # at the first start; the replacement reuses it (same spec)
    started = [e for e in lines if e["role"] == "decode" and " ready on " in e["event"]]
    assert len(started) == 2 and all(set(e["startup"]) >= {"interpreter", "imports", "engine", "calibration"}
                                     for e in started)
    for n, seconds in calibrated[0]["calibration"]["prefill"]:
        assert seconds == float(f"{seconds:.4g}")


def test_debug_level_samples_the_scheduler_steps(run):
    steps = [e["scheduler"]["step"] for e in _lines(run) if "scheduler" in e]
    assert steps, "no scheduler decisions at --log-level debug"
    assert all(step % 100 == 1 for step in steps)  # one step in a hundred, whatever the token count


# ---------------------------------------------------------------------------------------- units

def _captured(log_format: str, static: dict | None = None) -> io.StringIO:
    stream = io.StringIO()
    logs.install(log_format, "info", stream, static)
    return stream


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level, hooks = root.handlers[:], root.level, (sys.excepthook, threading.excepthook)
    yield
    root.handlers, root.level = handlers, level
    sys.excepthook, threading.excepthook = hooks
    logging.captureWarnings(False)


@pytest.mark.unit
def test_an_actor_renders_the_servers_format_from_the_environment(restore_logging):
    env = {}
    logs.export_settings("json", "warning", env)
    stream = io.StringIO()
    logs.configure_actor_logging("prefill-3", "prefill", stream, env)
    logging.getLogger("actor").info("not shown at warning")
    logging.getLogger("actor").warning("dropped %s", "r-1", extra={"request_id": "r-1"})
    (line,) = stream.getvalue().splitlines()
    event = json.loads(line)
    assert (event["actor"], event["role"], event["pid"], event["request_id"]) == ("prefill-3", "prefill",
                                                                                   os.getpid(), "r-1")
    assert event["event"] == "dropped r-1" and event["level"] == "warning"


@pytest.mark.unit
def test_without_exported_settings_an_actor_follows_its_terminal():
    assert logs.inherited_settings({}, io.StringIO()) == ("json", "info")
    assert logs.inherited_settings({logs.ENV_FORMAT: "console", logs.ENV_LEVEL: "DEBUG"}) == ("console", "debug")


@pytest.mark.unit
def test_console_lines_share_the_renderer(restore_logging):
    stream = _captured("console", {"actor": "decode-0", "role": "decode"})
    logging.getLogger("actor").info("ready")
    text = stream.getvalue()
    assert "ready" in text and "actor=decode-0" in text and not text.lstrip().startswith("{")


@pytest.mark.unit
def test_monotonic_points_drop_what_falls_below_an_earlier_point():
    points = [(32, 0.05), (128, 0.229), (384, 0.130), (512, 0.3)]
    kept, dropped = monotonic_points(points)
    assert kept == [(32, 0.05), (128, 0.229), (512, 0.3)] and dropped == [(384, 0.130)]
    assert monotonic_points([(4, 0.2), (1, 0.1)]) == ([(1, 0.1), (4, 0.2)], [])  # sorted by size first


@pytest.mark.unit
def test_the_cost_model_fits_only_the_rising_points():
    rising = [(32, 0.05), (128, 0.229)]
    assert PrefillCost.fit(rising + [(384, 0.130)]) == PrefillCost.fit(rising)
    assert DecodeCost.fit([(1, 0.02), (4, 0.01), (16, 0.05)]) == DecodeCost.fit([(1, 0.02), (16, 0.05)])


@pytest.mark.unit
def test_calibration_is_logged_once_rounded_and_a_falling_curve_warns(caplog):
    calib = Calibration([(32, 0.0512345678901), (128, 0.229), (384, 0.130)], [(1, 0.0201), (4, 0.0309)])
    logger = logging.getLogger("test_logs.calibration")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_calibration(calib, logger)
    info, warning = caplog.records
    assert info.levelno == logging.INFO and "0.05123" in info.getMessage() and "0.0512345" not in info.getMessage()
    assert info.calibration["prefill"][0] == [32, 0.05123]
    assert warning.levelno == logging.WARNING and warning.curve == "prefill" and warning.dropped == [[384, 0.13]]


@pytest.mark.unit
def test_a_rising_calibration_does_not_warn(caplog):
    with caplog.at_level(logging.INFO):
        log_calibration(Calibration([(32, 0.01), (128, 0.02)], [(1, 0.01)]), logging.getLogger("test_logs"))
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@pytest.mark.unit
def test_the_kernel_build_line_needs_a_missing_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    key = build.BuildKey(("avx2",), "0123456789abcdef")
    assert not build.is_built(key)  # load() would build, and say so
    (tmp_path / key.name).mkdir()
    assert not build.is_built(key)  # a directory without its library (an interrupted build) still builds
    (tmp_path / key.name / f"{key.name}.so").write_bytes(b"")
    assert build.is_built(key)  # cached: load() says nothing
