"""The `serve` command's own flags (the engine's come from EngineConfig through engine.flags), generated from
ServerSettings, LogSettings, ActorOptions and ElasticSettings, and their mapping back onto those objects.

Kept light to import: cli.py builds every sub-command's parser up front.
"""
from __future__ import annotations

import argparse
import os
import sys

from engine.flags import add_group, options
from router.elastic_settings import ElasticSettings
from server.logging import LogSettings, default_log_format
from server.quadrant import QuadrantThresholds
from server.settings import API_KEY_ENV, ActorOptions, ServerSettings

__all__ = ["API_KEY_ENV", "actor_options", "add_actor_args", "add_server_args", "log_settings",
           "quadrant_thresholds", "server_settings"]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, ServerSettings, "server")
    add_group(parser, LogSettings, "logging")


def add_actor_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, ActorOptions, "actors and placement")
    add_group(parser, ElasticSettings, "elastic layout")


def actor_settings(args: argparse.Namespace) -> ActorOptions:
    return ActorOptions(**options(ActorOptions, args))


def actor_options(args: argparse.Namespace) -> dict:
    """The AsyncLLM keyword arguments of the actor flags (with actors: the elastic layout's too)."""
    settings = actor_settings(args)
    elastic = {} if settings.in_process else {"elastic": ElasticSettings(**options(ElasticSettings, args))}
    return settings.client_options() | elastic


def quadrant_thresholds(args: argparse.Namespace, context: int) -> QuadrantThresholds:
    """Thresholds as given, else scaled to the served model's context (8192 -> 512 in, 256 out)."""
    return actor_settings(args).thresholds(context)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    values = options(ServerSettings, args)
    values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
    return ServerSettings(**values)


def log_settings(args: argparse.Namespace) -> LogSettings:
    values = options(LogSettings, args)
    values["format"] = values["format"] or default_log_format(sys.stderr)
    return LogSettings(**values)
