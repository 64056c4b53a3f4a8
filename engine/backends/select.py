"""The one place an engine's backend is chosen, from its device, dtype, --enforce-eager and, on a GPU, what
--gpu-attention asks and which packages import."""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from typing import Callable

import torch

from engine.backends.base import Backend
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.cuda_ops import CudaBackend
from engine.backends.dispatch import DispatchTable
from engine.backends.gpu_config import GpuConfig, resolve_attention
from engine.backends.torch_ops import TorchBackend

log = logging.getLogger(__name__)


def select_backend(device: torch.device | str, dtype: torch.dtype, enforce_eager: bool,
                   config: CpuKernelConfig | None = None, gpu: GpuConfig | None = None,
                   tune: Callable[[CpuKernelConfig], DispatchTable] | None = None) -> Backend:
    """On a CUDA device, the CUDA backend (gpu_backend); on the CPU, its kernels for a bf16 model (they must build
    and load: KernelBuildError otherwise, which names --enforce-eager), on the dispatch table `tune(config)` gives
    (the builder's: measured on this machine; None: the config's); plain torch ops under enforce_eager, for other
    dtypes on the CPU and on other devices."""
    kind = torch.device(device).type
    if kind == "cuda" and not enforce_eager:
        backend = gpu_backend(device, gpu or GpuConfig())
    elif enforce_eager or kind != "cpu" or dtype != torch.bfloat16:
        backend = TorchBackend(device)
    else:
        config = config or CpuKernelConfig()
        if tune is not None:
            config = dataclasses.replace(config, dispatch=tune(config))
        backend = CpuKernelBackend(config)
    log.info("backend %s", backend.describe())
    return backend


def gpu_backend(device: torch.device | str, gpu: GpuConfig) -> Backend:
    """The CUDA backend with the attention `gpu.attention` resolves to; plain torch ops (gather + SDPA), with a
    warning, where auto finds no Triton."""
    attention = resolve_attention(gpu.attention, importable("triton"), importable("flashinfer"))
    if attention == "torch":
        log.warning("Triton does not import: paged attention on %s gathers pages for SDPA", device)
        return TorchBackend(device)
    return CudaBackend(device, dataclasses.replace(gpu, attention=attention))


def importable(package: str) -> bool:
    """Whether `package` is installed (found without importing it)."""
    return importlib.util.find_spec(package) is not None
