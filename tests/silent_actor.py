"""A stand-in for an actor process in supervisor tests (`python -m tests.silent_actor --spec JSON`): it listens
where its spec says, greets with Hello, reports one stage of progress, and then says nothing more, as an actor
stuck in its model load would."""
from __future__ import annotations

import argparse
import asyncio
import os

from actors.spec import ActorSpec
from transport import Connection, serve_unix
from transport import messages as m

STAGE = m.StartupProgress("", "loading weights", 3, 10, "tensors")


async def main(spec: ActorSpec) -> None:
    async def greet(conn: Connection) -> None:
        await conn.send(m.Hello(spec.role.value, spec.device, os.getpid(), spec.actor_id))
        await conn.send(m.StartupProgress(spec.actor_id, STAGE.stage, STAGE.done, STAGE.total, STAGE.unit))
        await asyncio.Event().wait()  # silent from now on

    await serve_unix(spec.socket_path, greet)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    asyncio.run(main(ActorSpec.from_json(parser.parse_args().spec)))
