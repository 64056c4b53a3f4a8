"""The `serve` command's own flags (engine flags: engine.args) and their mapping onto the settings objects.

Kept light to import: cli.py builds every sub-command's parser up front.
"""
from __future__ import annotations

import argparse
import os
import sys

from server.logging import LOG_FORMATS, LOG_LEVELS, LogSettings, default_log_format
from server.quadrant import SPECULATE_QUADRANTS, QuadrantThresholds
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


def add_actor_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("actors and placement")
    g.add_argument("--decode-actors", type=int, default=1, help="decode actor processes (each also prefills "
                   "colocated requests in chunks)")
    g.add_argument("--prefill-actors", type=int, default=0, help="prefill actor processes (0: every request is "
                   "colocated)")
    g.add_argument("--devices", default="", help="comma-separated devices for the actors, e.g. cuda:0,cuda:1 "
                   "(default: CPU, cores split between actors)")
    g.add_argument("--disagg", choices=("auto", "always", "never"), default="auto",
                   help="disaggregate a request (prefill actor + KV hand-off) when the cost model says it pays, "
                   "always, or never")
    g.add_argument("--draft-actors", type=int, default=0,
                   help="with --speculative draft: draft model processes serving the decode actors (0: the draft "
                   "runs inside each decode actor)")
    g.add_argument("--listen-workers", default=None, metavar="HOST:PORT",
                   help="accept `cli.py worker --connect` actors from other hosts (secret: $PHASE_SERVE_SECRET)")
    g.add_argument("--in-process", action="store_true",
                   help="run the engine inside the server process instead of actor subprocesses (debugging)")
    g.add_argument("--long-prompt-threshold", type=int, default=None,
                   help="prompt tokens from which a request is long-in (default: context / 16, at least 64)")
    g.add_argument("--long-output-threshold", type=int, default=None,
                   help="max_tokens from which a request is long-out (default: context / 32, at least 64)")
    g.add_argument("--speculate-quadrants", choices=SPECULATE_QUADRANTS, default="silo",
                   help="with --speculative: which requests speculate, SILO ones only (short in, long out: bound "
                   "by inter-token latency) or all")


def actor_options(args: argparse.Namespace) -> dict:
    if args.in_process:
        return {}
    devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    return dict(decode_actors=args.decode_actors, prefill_actors=args.prefill_actors, devices=devices,
                disagg=args.disagg, listen_workers=args.listen_workers, draft_actors=args.draft_actors)


def quadrant_thresholds(args: argparse.Namespace, context: int) -> QuadrantThresholds:
    """Thresholds as given, else scaled to the served model's context (8192 -> 512 in, 256 out)."""
    return QuadrantThresholds(args.long_prompt_threshold or max(64, context // 16),
                              args.long_output_threshold or max(64, context // 32))


def server_settings(args: argparse.Namespace) -> ServerSettings:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return ServerSettings(host=args.host, port=args.port, api_key=api_key, max_queue=args.max_queue,
                          served_model_name=args.served_model_name, grace_period=args.grace_period,
                          speculate_quadrants=args.speculate_quadrants)


def log_settings(args: argparse.Namespace) -> LogSettings:
    return LogSettings(format=args.log_format or default_log_format(sys.stderr), level=args.log_level)
