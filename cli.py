"""Command line: `python cli.py serve`, `generate PROMPT`, `chat`, and `worker --connect HOST:PORT`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine.args import add_engine_args, engine_options


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", dest="sample_seed", type=int, default=None, help="sampling seed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cli.py", description="Phase-aware LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    chat = sub.add_parser("chat", help="interactive chat loop")
    for p in (gen, chat):
        add_engine_args(p)
        _sampling_args(p)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    _add_server_args(serve)
    worker = sub.add_parser("worker", help="an actor on this host joining a server on another (over TCP)")
    worker.add_argument("--role", choices=("decode", "prefill"), default="decode")
    worker.add_argument("--connect", required=True, metavar="HOST:PORT", help="the server's --listen-workers")
    worker.add_argument("--actor-id", default=None, help="unique name (default: ROLE-HOSTNAME-PID)")
    worker.add_argument("--secret-file", default=None, help="shared secret file (default: $PHASE_SERVE_SECRET)")
    worker.add_argument("--device", default="cpu", help="cpu or cuda:N")
    add_engine_args(worker)
    return parser


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    from server.args import add_actor_args, add_server_args  # here: only `serve` needs the server's packages

    add_server_args(parser)
    add_actor_args(parser)


def _sampling_params(args: argparse.Namespace):
    from engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sample_seed)


async def _stream_to_stdout(stream) -> str:
    text = ""
    async for out in stream:
        delta = out.outputs[0].delta_text
        text += delta
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return text


async def run_generate(args: argparse.Namespace) -> None:
    from engine import AsyncLLM

    llm = AsyncLLM(**engine_options(args))
    try:
        params = _sampling_params(args)
        if args.chat:
            await _stream_to_stdout(llm.chat([{"role": "user", "content": args.prompt}], params))
        else:
            await _stream_to_stdout(llm.generate(args.prompt, params))
    finally:
        llm.shutdown()


async def run_chat(args: argparse.Namespace) -> None:
    from engine import AsyncLLM

    llm = AsyncLLM(**engine_options(args))
    messages: list[dict[str, str]] = []
    try:
        while True:
            line = await asyncio.to_thread(_read_line)
            if line is None:
                return
            messages.append({"role": "user", "content": line})
            reply = await _stream_to_stdout(llm.chat(messages, _sampling_params(args)))
            messages.append({"role": "assistant", "content": reply})
    finally:
        llm.shutdown()


def _read_line() -> str | None:
    try:
        line = input("> ").strip()
    except EOFError:
        return None
    return None if line in ("/exit", "/quit") else line


def run_worker(args: argparse.Namespace) -> int:
    import os
    import socket

    from actors import worker
    from actors.spec import ActorSpec

    options = engine_options(args)
    actor_id = args.actor_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    spec = ActorSpec(actor_id, args.role, args.device, options.get("num_threads") or os.cpu_count() or 1,
                     engine=options, remote=True)
    extra = ["--secret-file", args.secret_file] if args.secret_file else []
    return worker.main(["--spec", spec.to_json(), "--connect", args.connect, *extra])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from server.main import serve

        return serve(args)
    if args.command == "worker":
        return run_worker(args)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    from engine.config import ConfigError
    from engine.model.errors import ModelLoadError

    runners = {"generate": run_generate, "chat": run_chat}
    try:
        asyncio.run(runners[args.command](args))
    except (ModelLoadError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
