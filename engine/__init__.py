"""Phase-aware LLM inference engine: `from engine import LLM, AsyncLLM, SamplingParams`.

`LLM` and `AsyncLLM` live in the `client` package, a layer above the engine and the router; they are reached
from here on first use (module `__getattr__`), so importing `engine` or any of its modules never imports the
client, the router or the transport."""
import importlib

from engine.config import EngineConfig, ModelConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.treatment import Treatment

_CLIENT_NAMES = {"LLM": "client.llm", "AsyncLLM": "client.async_llm"}

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput",
           "Treatment"]


def __getattr__(name: str):
    if name not in _CLIENT_NAMES:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_CLIENT_NAMES[name]), name)
