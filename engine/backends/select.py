"""The one place an engine's backend is chosen, from its device, dtype and --enforce-eager."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from engine.backends.base import Backend
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.dispatch import DispatchTable
from engine.backends.torch_ops import TorchBackend

log = logging.getLogger(__name__)


def select_backend(device: torch.device | str, dtype: torch.dtype, enforce_eager: bool,
                   config: CpuKernelConfig | None = None,
                   tune: Callable[[CpuKernelConfig], DispatchTable] | None = None) -> Backend:
    """The CPU kernels for a bf16 model on the CPU (they must build and load: KernelBuildError otherwise, which
    names --enforce-eager), on the dispatch table `tune(config)` gives (the builder's: measured on this machine;
    None: the config's); plain torch ops under enforce_eager, for other dtypes and on other devices."""
    if enforce_eager or torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        backend: Backend = TorchBackend(device)
    else:
        config = config or CpuKernelConfig()
        if tune is not None:
            config = dataclasses.replace(config, dispatch=tune(config))
        backend = CpuKernelBackend(config)
    log.info("backend %s", backend.describe())
    return backend
