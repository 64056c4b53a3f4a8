"""Phase-aware LLM inference engine: `from engine import LLM, AsyncLLM, SamplingParams`.

The names below load on first use, so that importing a light submodule (engine.config, engine.flags: what
cli.py needs to build its parsers) does not import torch.
"""
from importlib import import_module

_HOMES = {"LLM": "engine.llm", "AsyncLLM": "engine.llm", "SamplingParams": "engine.sampling_params",
          "EngineConfig": "engine.config", "ModelConfig": "engine.config", "RequestOutput": "engine.outputs",
          "CompletionOutput": "engine.outputs", "Treatment": "engine.treatment"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
