"""The hardware-specific operations on tensors, behind one Backend object per engine; nothing here knows a model.

base.Backend is the interface; torch_ops.TorchBackend runs plain torch ops (--enforce-eager, fp32/fp16, CUDA);
cpu_kernels.CpuKernelBackend the compiled CPU kernels, with every limit and switch in cpu_config.CpuKernelConfig;
select.select_backend picks one, once. dispatch holds the table of which kernel serves each weight format's row
counts (measured on the machine by kernel_timing, remembered by dispatch_store). weight_ops holds the weight
formats a product takes (weight_ops.Weight) and their plain-torch products; attention the paged attention.
"""
from engine.backends.base import Backend
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.select import select_backend
from engine.backends.torch_ops import TorchBackend
from engine.kernels.extension_build import KernelBuildError

__all__ = ["Backend", "CpuKernelBackend", "CpuKernelConfig", "KernelBuildError", "TorchBackend", "select_backend"]
