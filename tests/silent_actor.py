"""A stand-in for an actor process in supervisor tests (`python -m tests.silent_actor --spec JSON`): it listens
where its spec says, greets with Hello, reports one stage of progress, and then says nothing more, as an actor
stuck in its model load would. With `--fail-slowly`, it instead closes the connection and, a while later, writes
its reason where a failed start leaves it (actors.worker) and exits 1, as an actor whose start fails on a loaded
machine does: its connection closes before it writes and exits."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from actors.spec import ActorSpec
from transport import Connection, serve_unix
from transport import messages as m

STAGE = m.StartupProgress("", "loading weights", 3, 10, "tensors")
REASON = "the pool does not fit"
WIND_DOWN_SECONDS = 2.0  # between the closed connection and the reason: past a short wait for the exit


async def main(spec: ActorSpec, fail_slowly: bool) -> None:
    closed = asyncio.Event()

    async def greet(conn: Connection) -> None:
        await conn.send(m.Hello(spec.role.value, spec.device, os.getpid(), spec.actor_id))
        await conn.send(m.StartupProgress(spec.actor_id, STAGE.stage, STAGE.done, STAGE.total, STAGE.unit))
        if fail_slowly:
            await conn.aclose()
            closed.set()
        await asyncio.Event().wait()  # silent from now on

    await serve_unix(spec.socket_path, greet)
    await closed.wait()
    await asyncio.sleep(WIND_DOWN_SECONDS)
    Path(spec.error_path).write_text(REASON)
    sys.exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--fail-slowly", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(ActorSpec.from_json(args.spec), args.fail_slowly))
