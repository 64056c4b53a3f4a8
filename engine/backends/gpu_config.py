"""The GPU backend's switches, in one frozen config (engine/backends/cuda_ops.py), and the rule that picks its
attention kernels from what is asked and what imports (engine/backends/select.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import GPU_ATTENTIONS, GpuAttention

Resolved = Literal["triton", "flashinfer", "torch"]


@dataclass(frozen=True)
class GpuConfig:
    # paged attention on a CUDA device: the Triton kernels (engine/backends/triton_attention.py), FlashInfer's
    # decode kernel (the Triton ones for prefill), or auto: Triton where it imports
    attention: GpuAttention = "auto"
    # RMSNorm (+ residual add), RoPE on q and k, SiLU * up, the sampler's dense distribution as one
    # torch.compile'd kernel each
    compile_elementwise: bool = True
    # most context splits of a decode launch (a power of two): a small batch of long contexts fills the GPU
    max_splits: int = 16

    def __post_init__(self) -> None:
        if self.attention not in GPU_ATTENTIONS:
            raise ValueError(f"gpu attention must be one of {', '.join(GPU_ATTENTIONS)}, got {self.attention!r}")
        if self.max_splits < 1 or self.max_splits & (self.max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, got {self.max_splits}")


def resolve_attention(asked: GpuAttention, triton_imports: bool, flashinfer_imports: bool) -> Resolved:
    """The attention a CUDA engine runs: what was asked where its packages import (ValueError naming
    --gpu-attention where they do not); auto: Triton, else plain torch (gather + SDPA)."""
    if asked == "auto":
        return "triton" if triton_imports else "torch"
    missing = [name for name, ok in (("triton", triton_imports), ("flashinfer", flashinfer_imports))
               if not ok and (name == "triton" or asked == "flashinfer")]
    if missing:
        raise ValueError(f"--gpu-attention {asked} needs the {' and '.join(missing)} package(s), which do not "
                         "import here; install them or use --gpu-attention auto")
    return asked
