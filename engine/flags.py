"""Command-line flags generated from config dataclasses, so that a field's type, default, choices and help are
written once, beside the field.

A field declared with `option(default, help, ...)` becomes one flag of the dataclass's argparse group:
bool -> --x / --no-x, Literal[...] -> choices, `T | None` -> an optional T, anything else -> its type (or the
`parse` hook, e.g. parse_bytes). A field without `option` metadata is no flag. `options(cls, args)` turns
the parsed flags back into the dataclass's keyword arguments.

Kept light to import (no torch): cli.py builds every sub-command's parser up front.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap
import types
import typing
from typing import Any, Callable, Literal

_HELP = "help"
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6, "MIB": 1 << 20,
          "G": 1e9, "GB": 1e9, "GIB": 1 << 30}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, except that help lines never break inside a hyphenated word (--kv-cache-memory)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, shown: str | None = None) -> Any:
    """A dataclass field that is also a flag. flags: the option strings (default: --field-name), the first
    one is shown first; parse: converts the text; shown: how --help and docs/flags.md state the default when
    the value itself says little (None, an empty tuple). No default: the flag is required."""
    metadata = {_HELP: help, "flags": flags, "parse": parse, "metavar": metavar, "shown": shown}
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags, in declaration order."""
    return [f for f in dataclasses.fields(cls) if _HELP in f.metadata]


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def add_group(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One argparse group with a flag per `option` field of `cls`; each flag's dest is the field's name."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    taken = {action.dest for action in parser._actions}
    for f in flag_fields(cls):
        if f.name in taken:
            raise ValueError(f"flag dest {f.name!r} of {cls.__name__} is already used by this parser")
        group.add_argument(*flag_names(f), dest=f.name, **_argument(f, hints[f.name]))


def options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `cls` that its parsed flags set."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls)}


def shown_default(f: dataclasses.Field) -> str | None:
    """The default as --help states it; None for a required flag."""
    if f.default is dataclasses.MISSING:
        return None
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    return _show(f.default)


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _argument(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": _help_text(f), **_value_kwargs(f, _strip_none(hint))}
    if f.default is dataclasses.MISSING:
        return kwargs | {"required": True}
    return kwargs | {"default": f.default}


def _value_kwargs(f: dataclasses.Field, kind: Any) -> dict[str, Any]:
    """How argparse reads the value: a --x/--no-x pair, one of the Literal's values, or parsed text."""
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        return {"choices": choices, "type": f.metadata["parse"] or type(choices[0]), "metavar": f.metadata["metavar"]}
    return {"type": f.metadata["parse"] or kind, "metavar": f.metadata["metavar"]}


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return hint


def _help_text(f: dataclasses.Field) -> str:
    default = shown_default(f)
    text = f.metadata[_HELP] if default is None else f"{f.metadata[_HELP]} (default: {default})"
    return text.replace("%", "%%")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return format(value, "g")
    return "none" if value is None else str(value)


class ConfigFileError(ValueError):
    """A --config file that cannot be read, or that names a key no flag has."""


def config_file_argv(parser: argparse.ArgumentParser, path: str, skip: tuple[str, ...] = ("--config",)) -> list[str]:
    """The command-line words that a YAML file of `long-flag-name: value` pairs stands for, for `parser`.

    Keys are the long flag names without the dashes, with '-' or '_' between words; a boolean flag takes true
    or false, a list flag a YAML list or its comma-separated text, and null leaves the flag's default. The
    words go through the parser like typed flags, so a bad value gets the error the flag gets.
    """
    import difflib

    import yaml  # here: only a command given --config needs PyYAML

    try:
        with open(path, encoding="utf-8") as stream:  # a stream, so that YAML's messages name the file
            data = yaml.safe_load(stream)
    except OSError as exc:
        raise ConfigFileError(f"cannot read the config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"the config file {path} is not valid YAML ({' '.join(str(exc).split())})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigFileError(f"the config file {path} holds a {type(data).__name__}; expected a mapping of flag "
                              "names to values")
    actions = _file_flags(parser, skip)
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        action = actions.get(flag)
        if action is None:
            close = difflib.get_close_matches(flag, list(actions), n=1, cutoff=0.5)
            hint = f"the closest flag is {close[0]}" if close else f"see `{parser.prog} --help` for the flags"
            raise ConfigFileError(f"the config file {path} has the unknown key {key!r}; {hint}")
        words += _file_words(action, flag, value, path)
    return words


def _file_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...]) -> dict[str, argparse.Action]:
    """Long flag -> its action, for every flag a file may set (the negative --no-x of a switch excluded)."""
    flags: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        for flag in action.option_strings:
            negative = isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")
            if flag.startswith("--") and flag not in skip and not negative:
                flags[flag] = action
    return flags


def _file_words(action: argparse.Action, flag: str, value: Any, path: str) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigFileError(f"the config file {path} sets {flag[2:]} to {value!r}; expected true or false")
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(value, dict):
        raise ConfigFileError(f"the config file {path} sets {flag[2:]} to a mapping; expected one value")
    if isinstance(value, (list, tuple)):
        value = ",".join(_file_text(v) for v in value)
    return [f"{flag}={_file_text(value)}"]  # one word, so that a value starting with '-' stays a value


def _file_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
