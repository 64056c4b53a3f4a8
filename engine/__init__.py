"""Phase-aware LLM inference engine: `from engine import LLM, AsyncLLM, SamplingParams`."""
from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM, AsyncLLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.treatment import Treatment

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput",
           "Treatment"]
