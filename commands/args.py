"""The engine flags of `cli.py generate|chat|serve|worker` (generated from EngineConfig) and the sampling flags of
`generate` and `chat` (generated from SamplingOptions)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.flags import add_group, option, options, parse_bytes

__all__ = ["SamplingOptions", "add_engine_args", "add_sampling_args", "engine_options", "parse_bytes",
           "sampling_options"]


@dataclass(frozen=True)
class SamplingOptions:
    """What `generate` and `chat` ask of each reply; SamplingParams validates the values."""

    max_tokens: int = option(128, "most tokens to generate")
    temperature: float = option(0.0, "sampling temperature; 0 is greedy")
    top_p: float = option(1.0, "nucleus sampling: smallest set of tokens whose probabilities reach this sum")
    top_k: int = option(-1, "sample among the k likeliest tokens; -1 is all")
    seed: int | None = option(None, "sampling seed", shown="random")
    min_p: float = option(0.0, "drop tokens less likely than this times the likeliest one; 0 is off")
    presence_penalty: float = option(0.0, "subtract this from the logits of tokens already generated (-2 to 2)")
    frequency_penalty: float = option(0.0, "subtract this per earlier occurrence in the output (-2 to 2)")
    repetition_penalty: float = option(1.0, "divide positive logits (multiply negative ones) of tokens in the "
                                            "prompt or output by this; 1 is off")

    def params(self):
        """The SamplingParams these options describe."""
        from engine.sampling.sampling_params import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, min_p=self.min_p,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, EngineConfig, "engine")


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments that the parsed flags set."""
    return options(EngineConfig, args)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    add_group(parser, SamplingOptions, "sampling")


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    return SamplingOptions(**options(SamplingOptions, args))
