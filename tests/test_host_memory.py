"""keep_freed_memory: large CPU tensors freed at the end of a step stay in the process for the next step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.kv.host_memory import keep_freed_memory

MIB = 1 << 20

# A step's allocations in miniature: many activation-sized tensors, touched, then all freed. Both modes start
# from glibc's initial mmap threshold (128 KiB) pinned, so that every 1 MiB tensor is mmapped and unmapped on
# free: the resident size drops on every free and the next step faults the pages in again. Left to itself,
# glibc raises that threshold after the first free and may then trim the heap top or not, depending on where
# the heap lies (about 1 run in 4 here kept everything), so plain defaults would make a flaky reference.
# Bytes handed back are read from the resident size, which does not depend on the page size.
STEPS = textwrap.dedent("""
    import ctypes, json, os, resource, sys, torch
    from engine.kv.host_memory import M_MMAP_THRESHOLD, keep_freed_memory
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10) == 1
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    page = os.sysconf("SC_PAGE_SIZE")
    def resident():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page
    def step():
        tensors = [torch.empty(1 << 20, dtype=torch.uint8).fill_(1) for _ in range(40)]
        peak = resident()
        del tensors
        return peak - resident()
    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    handed_back = sorted(step() for _ in range(20))
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
    print(json.dumps({"handed_back": handed_back[10], "faults": faults}))
""")


def median_step_in_a_subprocess(mode: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                          check=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.process
def test_kept_memory_is_not_handed_back_to_the_kernel_between_steps():
    handing_back, kept = median_step_in_a_subprocess("hand back"), median_step_in_a_subprocess("keep")
    assert handing_back["handed_back"] > 30 * MIB  # the step's 40 MiB go back to the kernel on every free
    assert handing_back["faults"] > 10  # ~10,240 with 4 KiB pages, ~20 with 2 MiB pages
    assert kept["handed_back"] < 2 * MIB
    assert kept["faults"] * 10 < handing_back["faults"]


def test_keep_freed_memory_is_applied_once_per_process():
    assert keep_freed_memory() is keep_freed_memory()
    assert keep_freed_memory.cache_info().currsize == 1
