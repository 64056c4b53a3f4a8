"""The one log format of the server and its actors: structlog's JSON lines off a terminal, its console lines on
one. Standard-library records (the engine's, the actors', aiohttp's) go through the same renderer, so every
line a process writes to stderr has that format; each line names its process (`pid`, and in an actor `actor`
and `role`), and a record logged with `extra={"request_id": ...}` carries the id as a field.

The server picks the format and level (`serve --log-format / --log-level`) and exports them in the environment
(ENV_FORMAT, ENV_LEVEL); each actor process inherits that environment from the supervisor and configures the
same renderer from it. Without them (an actor started by hand) the format follows whether stderr is a terminal.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Mapping, TextIO

import structlog

ENV_FORMAT = "PHASE_SERVE_LOG_FORMAT"
ENV_LEVEL = "PHASE_SERVE_LOG_LEVEL"
FORMATS = ("json", "console")
LEVELS = ("debug", "info", "warning", "error")


def default_format(stream: TextIO) -> str:
    return "console" if stream.isatty() else "json"


def _fields(static: Mapping[str, Any]):
    """A processor that stamps the process's own fields (pid, actor, role) on every event."""
    def add(_logger: Any, _name: str, event: dict) -> dict:
        for key, value in static.items():
            event.setdefault(key, value)
        return event
    return add


def shared_processors(static: Mapping[str, Any] | None = None) -> list[Any]:
    """What both structlog and standard-library events pass through before rendering."""
    fields = {"pid": os.getpid(), **(static or {})}
    return [structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder(), _fields(fields),
            structlog.processors.TimeStamper(fmt="iso", utc=True)]


def renderer(log_format: str, stream: TextIO) -> list[Any]:
    if log_format == "json":
        return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    return [structlog.dev.ConsoleRenderer(colors=stream.isatty())]


def install(log_format: str, level: str, stream: TextIO = sys.stderr,
            static: Mapping[str, Any] | None = None) -> None:
    """Route the root logger to `stream` in `log_format`; Python warnings and uncaught exceptions (main thread
    and others) become records too, so nothing reaches stderr unformatted."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared_processors(static),
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer(log_format, stream)])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(args.exc_type, args.exc_value, args.exc_traceback)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("phase_serve.uncaught").critical("uncaught exception", exc_info=(kind, exc, tb))


def export_settings(log_format: str, level: str, environ: dict[str, str] | None = None) -> None:
    """Hand the server's format and level to the actor processes it will start (they inherit the environment)."""
    env = os.environ if environ is None else environ
    env[ENV_FORMAT], env[ENV_LEVEL] = log_format, level


def inherited_settings(environ: Mapping[str, str] | None = None, stream: TextIO = sys.stderr) -> tuple[str, str]:
    """(format, level) as the server exported them; unknown or missing values fall back to the defaults."""
    env = os.environ if environ is None else environ
    log_format = env.get(ENV_FORMAT, "")
    level = env.get(ENV_LEVEL, "").lower()
    return (log_format if log_format in FORMATS else default_format(stream),
            level if level in LEVELS else "info")


def configure_actor_logging(actor_id: str, role: str, stream: TextIO = sys.stderr,
                            environ: Mapping[str, str] | None = None) -> None:
    """An actor process's logging: the server's format and level, every line naming the actor."""
    log_format, level = inherited_settings(environ, stream)
    install(log_format, level, stream, {"actor": actor_id, "role": str(role)})
