"""The command line is generated from the config dataclasses: its defaults are theirs, every --help entry states
its default, docs/flags.md is generated from the parsers and matches --help, and parsed flags build the same
configs."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Literal

import pytest

import cli
from actors.start_watch import DEFAULT_START_SILENCE
from commands.args import SamplingOptions, add_engine_args, engine_options, sampling_options
from engine.config import OFFLINE, SERVING, ConfigError, EngineConfig
from commands.flag_reference import REQUIRED, markdown
from engine.flags import add_group, flag_fields, option, options, parse_bytes, shown_default
from server.args import actor_options, log_settings, quadrant_thresholds, server_settings
from server.logging import LogSettings
from server.settings import ActorOptions, ServerSettings
from router.elastic_settings import ElasticSettings

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("generate", "chat", "serve", "worker")
FLAG_CLASSES = (EngineConfig, SamplingOptions, ServerSettings, LogSettings, ActorOptions, ElasticSettings,
                cli.WorkerOptions, cli.GenerateOptions)
NOT_FLAGS = {EngineConfig: {"seed", "kv_host_dir", "itl_target"},  # set in code (itl_target: from --slo-itl)
             ServerSettings: {"max_body_bytes", "quadrants"},
             ElasticSettings: {"plan_interval", "window", "margin", "dwell", "cooldown", "min_requests",
                               "long_prompt_tokens", "long_output_tokens", "change_timeout", "switch_seconds"}}
DOCUMENTED_ELSEWHERE = {"--help"}  # argparse's own
FLAGS_PAGE = ROOT / "docs" / "flags.md"


@dataclasses.dataclass(frozen=True)
class HelpEntry:
    flags: tuple[str, ...]
    default: str | None


@functools.cache  # one `cli.py ... --help` process per sub-command for the whole module
def _help_text(*args: str) -> str:
    env = dict(os.environ, COLUMNS="100")
    done = subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _entries(help_text: str) -> list[HelpEntry]:
    """One entry per option in the --help text: its option strings and the default its help states."""
    blocks: list[list[str]] = []
    for line in help_text.splitlines():
        if re.match(r"  -", line):
            blocks.append([line])
        elif blocks and line.startswith("   "):
            blocks[-1].append(line)
        elif blocks and blocks[-1] is not None:
            blocks.append(None)
    return [_entry(" ".join(b)) for b in blocks if b is not None]


def _entry(text: str) -> HelpEntry:
    invocation = re.split(r"\s{2,}", text.strip(), maxsplit=1)[0]
    default = re.search(r"\(default: (.*)\)\s*$", " ".join(text.split()))
    return HelpEntry(tuple(re.findall(r"(?:^|, )(--?[\w-]+)", invocation)), default and default.group(1))


@pytest.fixture(scope="module")
def help_entries() -> dict[str, list[HelpEntry]]:
    return {command: _entries(_help_text(command, "--help")) for command in COMMANDS}


def _reference_rows() -> list[tuple[tuple[str, ...], str]]:
    """(flags, default) of each row of docs/flags.md's `| flag | default | meaning |` tables."""
    rows = []
    for line in FLAGS_PAGE.read_text().splitlines():
        if line.startswith("| `-"):
            flag_cell, default_cell = line.split(" | ")[:2]
            rows.append((tuple(re.findall(r"`(--?[\w-]+)`", flag_cell)), default_cell))
    return rows


def _by_flag(help_entries: dict[str, list[HelpEntry]]) -> dict[str, HelpEntry]:
    return {flag: entry for entries in help_entries.values() for entry in entries for flag in entry.flags}


def test_the_flag_reference_is_current():
    assert FLAGS_PAGE.read_text() == markdown(cli.build_parser()), \
        "docs/flags.md is out of date: make docs"


def test_reference_flags_exist_in_help_with_the_same_default(help_entries):
    by_flag = _by_flag(help_entries)
    rows = _reference_rows()
    assert len(rows) > 40
    for flags, default in rows:
        for flag in flags:
            assert flag in by_flag, f"docs/flags.md flag {flag} is in no sub-command's --help"
            assert (by_flag[flag].default or REQUIRED) == default, f"docs/flags.md default of {flag}"


def test_every_help_flag_is_in_the_reference(help_entries):
    documented = {flag for flags, _ in _reference_rows() for flag in flags} | DOCUMENTED_ELSEWHERE
    for command, entries in help_entries.items():
        for entry in entries:
            assert documented & set(entry.flags), f"`{command}` flag {entry.flags} is not in docs/flags.md"


def test_a_flag_shared_by_sub_commands_has_one_default(help_entries):
    seen: dict[str, str | None] = {}
    for entries in help_entries.values():
        for entry in entries:
            assert seen.setdefault(entry.flags[0], entry.default) == entry.default, entry.flags


def test_every_help_entry_states_its_default(help_entries):
    parser = cli.build_parser()
    required = {flag for sub in _subparsers(parser).values() for action in sub._actions if action.required
                for flag in action.option_strings}
    assert required == {"--connect"}
    for command, entries in help_entries.items():
        for entry in entries:
            if not set(entry.flags) & (required | DOCUMENTED_ELSEWHERE):
                assert entry.default is not None, f"`{command} --help`: {entry.flags} states no default"


def test_the_issue_s_flags_state_their_defaults(help_entries):
    serve, generate = _by_flag({"serve": help_entries["serve"]}), _by_flag({"generate": help_entries["generate"]})
    assert (serve["--port"].default, serve["--max-queue"].default, serve["--grace-period"].default) == \
        ("8000", "256", "30")
    assert (generate["--max-tokens"].default, generate["--temperature"].default) == ("128", "0")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("cls", FLAG_CLASSES, ids=lambda c: c.__name__)
def test_each_flag_default_is_its_field_default(cls):
    parser = argparse.ArgumentParser()
    add_group(parser, cls, "group")
    required = [a for a in parser._actions if a.required]
    args = parser.parse_args([arg for action in required for arg in (action.option_strings[0], "x")])
    for f in flag_fields(cls):
        if f.default is not dataclasses.MISSING:
            assert getattr(args, f.name) == f.default, f.name
    assert {f.name for f in dataclasses.fields(cls)} - {f.name for f in flag_fields(cls)} == NOT_FLAGS.get(cls, set())


def test_the_cli_defaults_build_the_default_configs(monkeypatch):
    monkeypatch.delenv("PHASE_SERVE_API_KEY", raising=False)
    parser = cli.build_parser()
    serve = parser.parse_args(["serve"])
    assert EngineConfig(**engine_options(serve)) == EngineConfig()
    assert server_settings(serve) == ServerSettings()
    assert actor_options(serve) == dict(decode_actors=1, prefill_actors=0, devices=(), disagg="auto",
                                        listen_workers=None, draft_actors=0, capacity_timeout=30.0,
                                        max_migrations=3, ray=None, start_silence=DEFAULT_START_SILENCE,
                                        elastic=ElasticSettings())
    assert sampling_options(parser.parse_args(["generate", "hi"])) == SamplingOptions()


def test_serve_and_llm_budgets_are_the_named_profiles():
    assert EngineConfig().max_num_batched_tokens == SERVING.max_num_batched_tokens == 512
    assert OFFLINE.max_num_batched_tokens == 2048
    args = cli.build_parser().parse_args(["serve"])
    assert args.max_num_batched_tokens == SERVING.max_num_batched_tokens


def test_parsed_flags_round_trip_into_the_configs(monkeypatch):
    monkeypatch.delenv("PHASE_SERVE_API_KEY", raising=False)
    args = cli.build_parser().parse_args([
        "serve", "--dtype", "float32", "--threads", "3", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
        "--speculative", "draft", "--draft-model", "self:2", "--num-speculative-tokens", "6",
        "--kv-cache-dtype", "fp8", "--kv-compress", "fp4", "--kv-compress-after", "64", "--kv-compress-share",
        "0.25", "--port", "0", "--max-queue", "9", "--grace-period", "1.5", "--speculate-quadrants", "all",
        "--log-format", "json", "--log-level", "debug", "--decode-actors", "2", "--devices", "cuda:0, cuda:1",
        "--disagg", "never", "--long-prompt-threshold", "100", "--max-migrations", "1", "--actor-start-silence", "300",
        "--elastic", "on", "--slo-itl", "0.05", "--no-degrade"])
    assert EngineConfig(**engine_options(args)) == EngineConfig(
        dtype="float32", num_threads=3, kv_cache_memory=2 << 30, enable_prefix_caching=False, speculative="draft",
        draft_model="self:2", num_speculative_tokens=6, kv_cache_dtype="fp8", kv_compress="fp4",
        kv_compress_after=64, kv_compress_share=0.25)
    assert server_settings(args) == ServerSettings(port=0, max_queue=9, grace_period=1.5, speculate_quadrants="all")
    assert log_settings(args) == LogSettings(format="json", level="debug")
    assert actor_options(args) == dict(decode_actors=2, prefill_actors=0, devices=("cuda:0", "cuda:1"),
                                       disagg="never", listen_workers=None, draft_actors=0,
                                       capacity_timeout=30.0, max_migrations=1, ray=None, start_silence=300.0,
                                       elastic=ElasticSettings(elastic="on", slo_itl=0.05, degrade=False))
    assert quadrant_thresholds(args, 8192) == type(quadrant_thresholds(args, 8192))(100, 256)


def test_threads_and_num_threads_set_num_threads():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_options(parser.parse_args(["--threads", "2"]))["num_threads"] == 2
    assert engine_options(parser.parse_args(["--num-threads", "5"]))["num_threads"] == 5


def test_in_process_runs_no_actors_and_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PHASE_SERVE_API_KEY", "from-env")
    args = cli.build_parser().parse_args(["serve", "--in-process", "--api-key", ""])
    assert actor_options(args) == {}
    assert server_settings(args).api_key == "from-env"


def test_worker_and_sampling_flags():
    args = cli.build_parser().parse_args(["worker", "--connect", "h:1", "--role", "prefill", "--threads", "2"])
    assert options(cli.WorkerOptions, args) == dict(connect="h:1", role="prefill", actor_id=None, secret_file=None,
                                                    device="cpu", kv_listen="")
    args = cli.build_parser().parse_args(["chat", "--seed", "7", "--temperature", "0.5", "--max-tokens", "3"])
    params = sampling_options(args).params()
    assert (params.seed, params.temperature, params.max_tokens) == (7, 0.5, 3)


@pytest.mark.parametrize("argv", [["serve", "--dtype", "float8"], ["serve", "--disagg", "sometimes"],
                                  ["serve", "--log-level", "loud"], ["worker"], ["serve", "--port", "x"],
                                  ["serve", "--kv-cache-memory", "lots"]])
def test_bad_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("options_, message", [
    (dict(dtype="float8"), "dtype must be one of auto, bfloat16, float16, float32, got 'float8'"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of auto, fp8, fp4, got 'int4'"),
    (dict(kv_compress="zip"), "kv_compress must be one of none, fp4, got 'zip'"),
    (dict(speculative="eagle"), "speculative must be one of off, ngram, draft, got 'eagle'"),
    (dict(kv_stream_overlap="always"), "kv_stream_overlap must be one of chunk, layer, none, got 'always'")])
def test_the_configs_still_validate_their_modes(options_, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineConfig(**options_)


def test_version_prints_the_package_version():
    assert _help_text("--version").strip() == f"cli.py {cli.version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", cli.version())


def test_version_falls_back_to_pyproject(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_building_the_parsers_does_not_import_torch():
    code = "import sys, cli; cli.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@dataclasses.dataclass(frozen=True)
class _Example:
    name: str = option(help="required: no default")
    mode: Literal["a", "b"] | None = option(None, "a mode", shown="auto")
    size: int | None = option(None, "bytes", parse=parse_bytes, flags=("--size", "-s"))
    on: bool = option(True, "a switch")
    ratio: float = option(0.25, "100% means all")
    internal: int = 3


def test_the_generator_maps_types_onto_argparse():
    parser = argparse.ArgumentParser()
    add_group(parser, _Example, "example")
    args = parser.parse_args(["--name", "n", "--mode", "b", "-s", "1KiB", "--no-on"])
    assert options(_Example, args) == dict(name="n", mode="b", size=1024, on=False, ratio=0.25)
    assert _Example(**options(_Example, args)).internal == 3
    text = " ".join(parser.format_help().split())
    assert "a mode (default: auto)" in text and "100% means all (default: 0.25)" in text
    assert "a switch (default: on)" in text and "(default:" not in text.split("required: no default")[1][:12]
    assert [shown_default(f) for f in flag_fields(_Example)] == [None, "auto", "none", "on", "0.25"]


def test_a_dest_used_twice_is_refused():
    parser = argparse.ArgumentParser()
    add_group(parser, _Example, "example")
    with pytest.raises(ValueError, match="already used"):
        add_group(parser, _Example, "again")


def test_generate_reports_a_bad_sampling_flag_as_an_error(tiny_model_dir, capsys):
    argv = ["generate", "hi", "--model", str(tiny_model_dir), "--dtype", "float32", "--threads", "1",
            "--temperature", "-1"]
    assert cli.main(argv) == 2
    assert "error: temperature must be between 0 and 2.0, got -1.0." in capsys.readouterr().err
