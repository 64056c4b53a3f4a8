"""What a SamplingParams field is beyond its type and default: the request fields that set it and on which
endpoints, how a request spells its value, its `generate` / `chat` flag, and whether a model's
generation_config.json may give its default.

Each sampling field is declared once, in SamplingParams, with `sampling_field(...)`; the server's request
parser, its table of request fields, the command line's sampling flags and the server's request defaults are
generated from those declarations. Kept light to import (no torch): cli.py builds its parsers from them.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

_KEY = "sampling"


class Endpoint(enum.StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


BOTH = (Endpoint.COMPLETIONS, Endpoint.CHAT)


class Shape(enum.Enum):
    """How a request spells a field's value (the server reads each shape)."""

    INTEGER = enum.auto()
    NUMBER = enum.auto()
    BOOLEAN = enum.auto()
    STRINGS = enum.auto()  # a string or an array of strings
    TOKEN_IDS = enum.auto()  # an array of integers
    TOKEN_BIAS = enum.auto()  # an object of token ids (as text) to numbers
    SEED = enum.auto()  # an integer that fits in 64 bits, signed or not
    LOGPROBS = enum.auto()  # completions: an integer; chat: a boolean, with the integer in the next name


@dataclass(frozen=True)
class ApiName:
    """A request field that sets a sampling field. `exclusive`: a request may not give it together with the
    field's other names (it is the same control under another name)."""

    name: str
    why: str  # what it does, for the table of request fields
    endpoints: tuple[Endpoint, ...] = BOTH
    exclusive: bool = False


class _Default(enum.Enum):
    FIELD = enum.auto()  # a flag's default is its field's


@dataclass(frozen=True)
class Flag:
    """The field's flag of `cli.py generate` and `chat`; `default` replaces the field's own there."""

    help: str
    default: Any = _Default.FIELD
    shown: str | None = None  # how --help states a default that says little by itself (None)


@dataclass(frozen=True)
class SamplingField:
    names: tuple[ApiName, ...] = ()  # in precedence order: the first one a request gives sets the field
    shape: Shape | None = None
    flag: Flag | None = None
    generation_config: bool = False  # generation_config.json's value of the same name is the server's default

    def __post_init__(self) -> None:
        if bool(self.names) != (self.shape is not None):
            raise ValueError("a sampling field with request names needs a shape, and only then")

    def names_on(self, endpoint: Endpoint) -> tuple[ApiName, ...]:
        return tuple(n for n in self.names if endpoint in n.endpoints)


def sampling_field(default: Any, shape: Shape | None = None, *names: ApiName, flag: Flag | None = None,
                   generation_config: bool = False) -> Any:
    """A SamplingParams field with its declaration; no names: no request sets it."""
    return dataclasses.field(default=default, metadata={_KEY: SamplingField(names, shape, flag, generation_config)})


def declared(cls: type) -> list[tuple[dataclasses.Field, SamplingField]]:
    """The fields of `cls` declared with sampling_field, in declaration order."""
    return [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def generation_config_names(cls: type) -> tuple[str, ...]:
    """The fields of `cls` whose server default generation_config.json may give, in declaration order."""
    return tuple(f.name for f, spec in declared(cls) if spec.generation_config)


def flag_default(f: dataclasses.Field, spec: SamplingField) -> Any:
    """The default of the field's flag."""
    assert spec.flag is not None
    return f.default if spec.flag.default is _Default.FIELD else spec.flag.default
