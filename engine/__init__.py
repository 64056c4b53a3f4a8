"""Phase-aware LLM inference engine: `from engine import LLM, AsyncLLM, SamplingParams`.

Every name below loads on first use (module `__getattr__`): importing a light submodule (engine.config,
engine.flags: what cli.py needs to build its parsers) does not import torch, and importing `engine` or any of
its modules never imports the `client` package (a layer above the engine and the router, where `LLM` and
`AsyncLLM` live), the router or the transport.
"""
from importlib import import_module

_HOMES = {"LLM": "client.llm", "AsyncLLM": "client.async_llm", "SamplingParams": "engine.sampling.sampling_params",
          "EngineConfig": "engine.config", "ModelConfig": "engine.config", "RequestOutput": "engine.core.outputs",
          "CompletionOutput": "engine.core.outputs", "EmbeddingOutput": "engine.core.outputs",
          "Treatment": "engine.core.treatment"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
