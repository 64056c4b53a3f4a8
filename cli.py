"""Command line: `python cli.py serve [MODEL]`, `generate PROMPT`, `chat`, `worker --connect HOST:PORT`, and
`completion bash|zsh`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from commands.args import add_engine_args, add_sampling_args, engine_options, sampling_options
from engine.flags import ConfigFileError, HelpFormatter, add_group, config_file_argv, option, options

PACKAGE = "phase-serve"
SHELLS = ("bash", "zsh")


@dataclass(frozen=True)
class GenerateOptions:
    chat: bool = option(False, "wrap the prompt as one user message (chat template)")


@dataclass(frozen=True)
class ChatOptions:
    system: str | None = option(None, "a system message that opens the conversation (/system TEXT changes it)",
                                shown="none")


@dataclass(frozen=True)
class ConfigFileOptions:
    """`serve --config FILE`: vLLM's YAML file of long flag names and values."""

    config: str | None = option(None, "a YAML file of flags, long names as keys (`port: 8001`, `max_num_seqs: 32`); "
                                "flags given on the command line win over it", metavar="FILE", shown="none")


@dataclass(frozen=True)
class WorkerOptions:
    """`worker`: an actor on this host that joins a server on another."""

    connect: str = option(help="the server's --listen-workers address", metavar="HOST:PORT")
    role: Literal["decode", "prefill"] = option("decode", "the actor's role")
    actor_id: str | None = option(None, "unique name", shown="ROLE-HOSTNAME-PID")
    secret_file: str | None = option(None, "shared secret file", shown="$PHASE_SERVE_SECRET", metavar="FILE")
    device: str = option("cpu", "cpu or cuda:N")
    kv_listen: str = option("", "a decode worker's KV endpoint, where prefill actors stream pages to it directly "
                            "(off: the server relays them)", shown="the address it joins from, a free port",
                            metavar="HOST:PORT|off")


def version() -> str:
    """The installed package's version, else the one pyproject.toml declares."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        import tomllib

        return tomllib.loads((Path(__file__).parent / "pyproject.toml").read_text())["project"]["version"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cli.py", description="Phase-aware LLM inference server",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = _command(sub, "generate", "stream one completion to stdout (only the generated text; logs go to stderr)")
    gen.add_argument("prompt", help="the prompt text")
    add_group(gen, GenerateOptions, "generate")
    chat = _command(sub, "chat", "interactive chat loop (/system TEXT, /reset, /help; /exit or Ctrl-D ends it)")
    add_group(chat, ChatOptions, "chat")
    for p in (gen, chat):
        add_engine_args(p)
        add_sampling_args(p)
    serve = _command(sub, "serve", "OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model takes it (vLLM's "
                       "positional form; the default model when neither is given)")
    add_group(serve, ConfigFileOptions, "config file")
    add_engine_args(serve)
    _add_server_args(serve)
    worker = _command(sub, "worker", "an actor on this host joining a server on another (over TCP)")
    add_group(worker, WorkerOptions, "worker")
    add_engine_args(worker)
    completion = _command(sub, "completion", "print a shell completion script: "
                          "`source <(python cli.py completion bash)`, or the same with zsh")
    completion.add_argument("shell", choices=SHELLS, help="the shell to complete for")
    return parser


def _command(sub, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                          formatter_class=HelpFormatter)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    from server.args import add_actor_args, add_server_args  # here: only `serve` needs the server's packages

    add_server_args(parser)
    add_actor_args(parser)


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
        params = sampling_options(args).params()
        if GenerateOptions(**options(GenerateOptions, args)).chat:
            await _stream_to_stdout(llm.chat([{"role": "user", "content": args.prompt}], params))
        else:
            await _stream_to_stdout(llm.generate(args.prompt, params))
    finally:
        llm.shutdown()


async def run_chat(args: argparse.Namespace) -> None:
    from client.chat_session import HELP, Action, ChatSession
    from engine import AsyncLLM

    llm = AsyncLLM(**engine_options(args))
    session = ChatSession(ChatOptions(**options(ChatOptions, args)).system)
    print(f"chatting with {llm.model_name}; {HELP}", file=sys.stderr)
    try:
        while (line := await asyncio.to_thread(_read_line)) is not None:
            step = session.handle(line)
            if step.action is Action.EXIT:
                return
            if step.action is Action.SAY:
                print(step.text, file=sys.stderr)
            elif step.action is Action.REPLY:
                session.replied(await _stream_to_stdout(llm.chat(session.messages, sampling_options(args).params())))
    finally:
        llm.shutdown()


def _read_line() -> str | None:
    try:
        return input("> ")
    except EOFError:
        return None


def run_worker(args: argparse.Namespace) -> int:
    import os
    import socket

    from actors import worker
    from actors.spec import ActorSpec

    engine = engine_options(args)
    opts = WorkerOptions(**options(WorkerOptions, args))
    actor_id = opts.actor_id or f"{opts.role}-{socket.gethostname()}-{os.getpid()}"
    spec = ActorSpec(actor_id, opts.role, opts.device, engine.get("num_threads") or os.cpu_count() or 1,
                     engine=engine, remote=True, kv_listen=opts.kv_listen)
    extra = ["--secret-file", opts.secret_file] if opts.secret_file else []
    return worker.main(["--spec", spec.to_json(), "--connect", opts.connect, *extra])


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the flags of a `--config` file put before the command's own (so those win), and
    `serve MODEL` folded into --model."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) and args.model is not None and args.model != args.model_tag:
        _subparser(parser, args.command).error(f"the model is given twice, as {args.model_tag!r} and as "
                                               f"--model {args.model!r}; give one")
    if getattr(args, "config", None):
        command = _subparser(parser, args.command)
        try:
            words = config_file_argv(command, args.config)
        except ConfigFileError as exc:
            command.error(str(exc))
        _parse_as_file(command, args.config, words)
        at = argv.index(args.command) + 1
        args = parser.parse_args([*argv[:at], *words, *argv[at:]])
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return args


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def _parse_as_file(command: argparse.ArgumentParser, path: str, words: list[str]) -> None:
    """Parses the file's words alone first, so that a bad value in the file is reported as the file's."""
    def error(message: str) -> None:
        argparse.ArgumentParser.error(command, f"in the config file {path}: {message}")

    command.error = error  # an instance attribute: this parser only, for this one parse
    try:
        command.parse_args(words)
    finally:
        del command.error


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command == "completion":
        from commands.completion import completion_script

        sys.stdout.write(completion_script(parser, args.shell))
        return 0
    if args.command == "serve":
        from server.main import serve

        return serve(args)
    if args.command == "worker":
        return run_worker(args)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    from engine.config import ConfigError
    from engine.model.errors import ModelLoadError
    from engine.sampling.sampling_params import SamplingParamsError

    runners = {"generate": run_generate, "chat": run_chat}
    try:
        asyncio.run(runners[args.command](args))
    except (ModelLoadError, ConfigError, SamplingParamsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
