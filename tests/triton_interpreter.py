"""The Triton kernels for a test module: interpreted on the CPU (TRITON_INTERPRET=1, set here before Triton first
decorates them) where there is no CUDA device, compiled on one where there is. Import the kernels through this
module, before anything else builds a CudaBackend in the test process."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.backends import triton_attention  # noqa: E402  (after the variable: Triton reads it as it decorates)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kernels():
    """The kernel module; an AssertionError where it was compiled for a GPU this process does not have (it was
    imported before the interpreter was asked for)."""
    interpreted = type(triton_attention._decode_kernel).__name__ == "InterpretedFunction"
    assert interpreted or DEVICE.type == "cuda", (
        "engine.backends.triton_attention was imported before TRITON_INTERPRET was set; import it through "
        "tests/triton_interpreter.py")
    return triton_attention
