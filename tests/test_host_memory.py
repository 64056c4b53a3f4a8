"""keep_freed_memory: repeated large CPU tensors stop page-faulting once glibc keeps freed memory."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from engine.host_memory import keep_freed_memory

# A step's allocations in miniature: many activation-sized tensors, touched, then all freed. With glibc's
# defaults the freed heap top is trimmed (returned to the kernel) and the next step faults it back in.
STEPS = textwrap.dedent("""
    import resource, sys, torch
    from engine.host_memory import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def step():
        tensors = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(40)]
        del tensors
    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def faults_per_step(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(done.stdout.split()[-1])


def test_kept_memory_removes_the_page_faults_of_repeated_large_tensors():
    default, kept = faults_per_step("default"), faults_per_step("keep")
    assert default > 5000  # glibc's defaults give the 40 MiB back to the kernel on every step (~10240 pages)
    assert kept * 10 < default


def test_keep_freed_memory_is_applied_once_per_process():
    assert keep_freed_memory() is keep_freed_memory()
    assert keep_freed_memory.cache_info().currsize == 1
