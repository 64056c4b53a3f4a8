"""The actor process entry point: `python -m actors.worker --spec JSON [--connect HOST:PORT]`, and `run_actor`,
which the Ray actors (actors.ray_actors) call in their own processes.

It makes the role's actor (actors/roles.py: decode_actor, prefill_actor, draft_actor), ties its life to the
parent's and runs it on uvloop."""
from __future__ import annotations

import time

ENTERED = time.time()  # before the heavy imports below: the start-up line splits interpreter from imports

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from actors.logs import configure_actor_logging
from actors.roles import make_actor
from actors.spec import ActorSpec
from actors.startup import Startup
from engine.kv.export import SharedMemoryError
from transport import load_secret

log = logging.getLogger("actor")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: get SIGTERM (a clean stop) if the server process dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        log.warning("cannot tie this actor's life to its parent; it must be stopped explicitly")
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(0)


def _leave_sigint_to_the_supervisor() -> None:
    """A terminal's Ctrl-C reaches the whole process group: the server drains its streams on it, then stops its
    actors with SIGTERM. An actor that exited on the SIGINT itself would cut those streams off."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actors.worker")
    parser.add_argument("--spec", required=True, help="ActorSpec as JSON")
    parser.add_argument("--connect", default=None, help="HOST:PORT of a server to join over TCP")
    parser.add_argument("--secret-file", default=None, help="shared secret (else $PHASE_SERVE_SECRET)")
    args = parser.parse_args(argv)
    spec = ActorSpec.from_json(args.spec)
    if args.connect is None:
        return run_actor(spec)
    host, port = args.connect.rsplit(":", 1)
    return run_actor(spec, (host, int(port), load_secret(args.secret_file)))


def run_actor(spec: ActorSpec, join: tuple[str, int, bytes] | None = None, entered: float = ENTERED) -> int:
    """Run the spec's actor until it stops: serving its Unix socket for a local supervisor, or, with
    `join=(host, port, secret)`, joining a server over TCP (`cli.py worker --connect`, and each Ray actor).
    Returns the exit status."""
    configure_actor_logging(spec.actor_id, spec.role)  # the server's format and level, from the environment
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    if not spec.remote:
        _die_with_parent()
        _leave_sigint_to_the_supervisor()
    torch.set_num_threads(spec.threads)
    try:
        import uvloop
        actor = make_actor(spec)
        actor.startup = Startup.of_this_process(entered)
        uvloop.run(actor.run() if join is None else actor.run_connected(*join))
    except KeyboardInterrupt:
        pass
    except Exception as exc:
        _report_fatal(spec, exc)
        return 1
    return 0


def _report_fatal(spec: ActorSpec, exc: Exception) -> None:
    """Log why the actor stops and leave the reason where its supervisor reports it from (spec.error_path)."""
    reason = str(exc) if isinstance(exc, SharedMemoryError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SharedMemoryError):
        log.error("cannot start: %s", reason)
    else:
        log.exception("actor %s failed", spec.actor_id)
    if spec.error_path:
        try:
            Path(spec.error_path).write_text(reason)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
