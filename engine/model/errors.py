"""Errors raised while locating and reading model checkpoints."""
from __future__ import annotations


class ModelLoadError(Exception):
    """A model path is missing or unsupported; the message is one sentence naming what was expected."""
