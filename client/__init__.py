"""The embedded client, the layer above the router: `LLM` (blocking, batch) and `AsyncLLM` (streaming), modelled
on vLLM's API. `from engine import LLM, AsyncLLM` reaches the same classes."""
from client.async_llm import AsyncLLM
from client.llm import LLM, OFFLINE_MAX_NUM_BATCHED_TOKENS

__all__ = ["LLM", "AsyncLLM", "OFFLINE_MAX_NUM_BATCHED_TOKENS"]
