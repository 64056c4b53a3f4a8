"""The hardware-specific operations on tensors, behind one Backend object per engine; nothing here knows a model.

base.Backend is the interface; torch_ops.TorchBackend runs plain torch ops (--enforce-eager, fp32/fp16 on the
CPU); cpu_kernels.CpuKernelBackend the compiled CPU kernels, with every limit and switch in
cpu_config.CpuKernelConfig; cuda_ops.CudaBackend a CUDA device's, with paged attention in Triton
(triton_attention, imported only when that backend is built) or FlashInfer's decode (flashinfer_attention) and its
switches in gpu_config.GpuConfig; select.select_backend picks one, once. dispatch holds the table of which CPU
kernel serves each weight format's row counts (measured on the machine by kernel_timing, remembered by
dispatch_store). weight_ops holds the weight formats a product takes (weight_ops.Weight) and their plain-torch
products; attention the paged attention.
"""
from engine.backends.base import Backend
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.cpu_kernels import CpuKernelBackend
from engine.backends.cuda_ops import CudaBackend
from engine.backends.gpu_config import GpuConfig
from engine.backends.select import select_backend
from engine.backends.torch_ops import TorchBackend
from engine.kernels.extension_build import KernelBuildError

__all__ = ["Backend", "CpuKernelBackend", "CpuKernelConfig", "CudaBackend", "GpuConfig", "KernelBuildError",
           "TorchBackend", "select_backend"]
