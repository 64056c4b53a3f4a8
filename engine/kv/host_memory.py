"""Keep freed heap memory in the process instead of handing it back to the kernel after every step.

torch's CPU allocator frees tensors straight to malloc. A prefill step's activations are large (a
2048-token chunk's MLP product is 12 MB) and glibc returns such blocks to the kernel: blocks above its mmap
threshold are unmapped on free, and free space at the top of the heap is trimmed. The next step then pays a
page fault and a zeroed page for every 4 KiB it touches again. Counted with getrusage around the prefill of
64 prompts of 128 tokens in 2048-token steps (SmolLM2, bf16): 35-54 thousand minor faults per step with
glibc's defaults, 0.5-4.3 thousand with the thresholds raised. vLLM's CPU backend asks for tcmalloc for the
same reason; raising glibc's two thresholds gets most of it without a preloaded library. The price: the
resident size stays at its peak (about one step's largest activations) after a burst instead of shrinking.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value: bigger blocks (KV pages, weights) still mmap
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap top kept before glibc gives any back


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.warning("mallopt refused the heap thresholds; large CPU tensors will page-fault on every step")
    return done


def release_freed_memory() -> bool:
    """Hands the heap's free pages back to the kernel now (glibc's malloc_trim), whatever the trim threshold: after
    a one-off burst such as converting a model's weights, whose temporaries would otherwise stay resident. False
    where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
