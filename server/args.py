"""The `serve` command's own flags (engine flags: engine.args) and their mapping onto the settings objects.

Kept light to import: cli.py builds every sub-command's parser up front.
"""
from __future__ import annotations

import argparse
import os
import sys

from server.logging import LOG_FORMATS, LOG_LEVELS, LogSettings, default_log_format
from server.settings import ServerSettings

API_KEY_ENV = "PHASE_SERVE_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    g.add_argument("--max-queue", type=int, default=256, help="requests in flight before new ones get 429")
    g.add_argument("--served-model-name", default=None, help="model name clients send (default: the model's)")
    g.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="json or console (default: console on a terminal, json otherwise)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")


def server_settings(args: argparse.Namespace) -> ServerSettings:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return ServerSettings(host=args.host, port=args.port, api_key=api_key, max_queue=args.max_queue,
                          served_model_name=args.served_model_name, grace_period=args.grace_period)


def log_settings(args: argparse.Namespace) -> LogSettings:
    return LogSettings(format=args.log_format or default_log_format(sys.stderr), level=args.log_level)
