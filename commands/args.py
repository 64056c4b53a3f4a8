"""The engine flags of `cli.py generate|chat|serve|worker` (generated from EngineConfig) and the sampling flags of
`generate` and `chat` (generated from SamplingParams' field declarations)."""
from __future__ import annotations

import argparse
import dataclasses

from engine.config import EngineConfig
from engine.flags import add_group, option, options, parse_bytes
from engine.sampling.fields import declared, flag_default
from engine.sampling.sampling_params import SamplingParams

__all__ = ["SamplingOptions", "add_engine_args", "add_sampling_args", "engine_options", "parse_bytes",
           "sampling_options"]


_OPTIONS_DOC = """What `generate` and `chat` ask of each reply: the flags (help, and the command line's default where
it differs from the library's) are declared beside the SamplingParams fields; SamplingParams validates the values."""


def _sampling_options_class() -> type:
    """SamplingOptions, a field per SamplingParams field declared with a flag."""
    fields = [(f.name, f.type, option(flag_default(f, spec), spec.flag.help, shown=spec.flag.shown))
              for f, spec in declared(SamplingParams) if spec.flag is not None]
    return dataclasses.make_dataclass("SamplingOptions", fields, frozen=True,
                                      namespace={"__module__": __name__, "__doc__": _OPTIONS_DOC,
                                                 "params": _params})


def _params(self) -> SamplingParams:
    """The SamplingParams these options describe."""
    return SamplingParams(**dataclasses.asdict(self))


SamplingOptions = _sampling_options_class()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, EngineConfig, "engine")


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments that the parsed flags set."""
    return options(EngineConfig, args)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, SamplingOptions, "sampling")


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    return SamplingOptions(**options(SamplingOptions, args))
