"""structlog set-up: JSON lines off a terminal, coloured console lines on one. Standard-library records (the
engine's, aiohttp's) go through the same renderer, so every line on stderr has one format; the actor processes
render theirs the same way (actors.logs), so the server's stderr is one stream."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal, TextIO, get_args

import structlog

from actors import logs
from engine.config import ConfigError
from engine.flags import option

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_FORMATS = get_args(LogFormat)
LOG_LEVELS = get_args(LogLevel)
SERVER_FIELDS = {"role": "server"}  # actor lines carry their actor id and role instead


@dataclass(frozen=True)
class LogSettings:
    """The `serve` flags --log-format and --log-level (engine.flags); format None: default_log_format."""

    format: LogFormat | None = option(None, "one line per event, request id on every request line: json or "
                                      "console", flags=("--log-format",), shown="console on a terminal, else json")
    level: LogLevel = option("info", "least severe level logged", flags=("--log-level",))

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in LOG_FORMATS:
            raise ConfigError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {self.format!r}")
        if self.level not in LOG_LEVELS:
            raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")


def default_log_format(stream: TextIO) -> str:
    return logs.default_format(stream)


def configure_logging(settings: LogSettings, stream: TextIO = sys.stderr) -> structlog.stdlib.BoundLogger:
    """Routes the root logger to `stream` in the chosen format, exports the format and level for the actor
    processes (actors.logs), and returns the server's logger. Every line carries `pid` and `role` "server"."""
    log_format = settings.format or default_log_format(stream)
    logs.install(log_format, settings.level, stream, SERVER_FIELDS)
    logs.export_settings(log_format, settings.level)
    logging.getLogger("aiohttp.access").disabled = True  # the server writes its own access line
    return make_logger()


def make_logger(name: str = "phase_serve.server") -> structlog.stdlib.BoundLogger:
    """A structlog logger over the standard-library logger `name` (rendered by whatever handler it reaches)."""
    processors = [structlog.stdlib.filter_by_level, *logs.shared_processors(SERVER_FIELDS),
                  structlog.stdlib.ProcessorFormatter.wrap_for_formatter]
    return structlog.wrap_logger(logging.getLogger(name), processors=processors,
                                 wrapper_class=structlog.stdlib.BoundLogger)
