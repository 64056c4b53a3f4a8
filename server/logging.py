"""structlog set-up: JSON lines off a terminal, coloured console lines on one. Standard-library records (the
engine's, aiohttp's) go through the same renderer, so every line on stderr has one format."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal, TextIO, get_args

import structlog

from engine.config import ConfigError
from engine.flags import option

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_FORMATS = get_args(LogFormat)
LOG_LEVELS = get_args(LogLevel)


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
    return "console" if stream.isatty() else "json"


def _shared_processors() -> list[Any]:
    return [structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name, structlog.processors.TimeStamper(fmt="iso", utc=True)]


def _renderer(settings: LogSettings, stream: TextIO) -> list[Any]:
    if settings.format == "json":
        return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    return [structlog.dev.ConsoleRenderer(colors=stream.isatty())]


def configure_logging(settings: LogSettings, stream: TextIO = sys.stderr) -> structlog.stdlib.BoundLogger:
    """Routes the root logger to `stream` in the chosen format; returns the server's logger."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_shared_processors(),
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_renderer(settings, stream)])
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(settings.level.upper())
    logging.getLogger("aiohttp.access").disabled = True  # the server writes its own access line
    return make_logger()


def make_logger(name: str = "phase_serve.server") -> structlog.stdlib.BoundLogger:
    """A structlog logger over the standard-library logger `name` (rendered by whatever handler it reaches)."""
    processors = [structlog.stdlib.filter_by_level, *_shared_processors(),
                  structlog.stdlib.ProcessorFormatter.wrap_for_formatter]
    return structlog.wrap_logger(logging.getLogger(name), processors=processors,
                                 wrapper_class=structlog.stdlib.BoundLogger)
