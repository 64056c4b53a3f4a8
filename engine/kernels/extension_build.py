"""Build and load the C++ CPU kernels, one build per key.

The key is the ISA extensions `-march=native` turns on here (what the code was compiled for: a build made on
an AMX host dies with SIGILL on one without) and a digest of the sources, headers, flags and torch version. The
extension's name carries the key, so its build directory does too: two checkouts or two CPUs sharing one
TORCH_EXTENSIONS_DIR never evict each other's build, and each key compiles once.

`python -m engine.kernels.build` (`make kernels`) builds ahead of the first server or test.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("cpu_ext.cpp", "decode_stack.cpp", "tiled_linear.cpp", "prompt_attention.cpp",
                                              "int8_linear.cpp", "int4_linear.cpp", "int8_grouped.cpp"))
HEADERS = tuple(HERE / name for name in ("activation_quant.h", "amx.h", "bf16_dots.h", "parallel.h", "vec.h"))
# -fopenmp: at::parallel_for is inline OpenMP; the extension then binds to the libgomp torch already loaded.
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# The ISA extensions the kernels' code paths test for (directly or through the intrinsics they use).
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16", "avx512fp16",
            "avx512vnni", "amx-tile", "amx-bf16")
_CPUINFO_NAMES = {"avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avx512vnni": "avx512_vnni"}


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be built or loaded."""


@dataclass(frozen=True)
class BuildKey:
    features: tuple[str, ...]  # the FEATURES the build targets
    digest: str  # sources, headers, flags, features, torch version

    @property
    def name(self) -> str:
        """The extension's name (a Python identifier), and its build directory's."""
        return f"phase_serve_cpu_ext_{isa_tag(self.features)}_{self.digest}"


def isa_tag(features: tuple[str, ...]) -> str:
    """The most capable matrix / vector level among `features`, for readable names."""
    for feature, tag in (("amx-bf16", "amx"), ("avx512bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if feature in features:
            return tag
    return "base"


def compiler() -> str:
    """The C++ compiler torch's cpp_extension runs."""
    return os.environ.get("CXX", "c++")


@functools.cache
def target_features(cxx: str) -> tuple[str, ...]:
    """The FEATURES `cxx -march=native` enables here: the compiler's own answer, else /proc/cpuinfo's flags."""
    try:
        out = subprocess.run([cxx, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return _cpuinfo_features()
    enabled = set(re.findall(r"^\s+-m([\w-]+)\s+\[enabled\]", out, re.MULTILINE))
    return tuple(f for f in FEATURES if f in enabled)


def _cpuinfo_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo.read_text(), re.MULTILINE).group(1).split())
    except (OSError, AttributeError):
        return ()
    return tuple(f for f in FEATURES if _CPUINFO_NAMES.get(f, f.replace("-", "_")) in flags)


@functools.cache
def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo's model name, else what platform says): which machine a measurement of
    the kernels' speed was taken on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key(features: tuple[str, ...] | None = None) -> BuildKey:
    """The key of this checkout's sources built for `features` (default: what the compiler targets here)."""
    import torch

    features = target_features(compiler()) if features is None else features
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr((CFLAGS, LDFLAGS, features, torch.__version__)).encode())
    return BuildKey(features, digest.hexdigest()[:16])


def build_directory(key: BuildKey) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / key.name


def is_built(key: BuildKey) -> bool:
    return (build_directory(key) / f"{key.name}.so").exists()


def load(key: BuildKey) -> ModuleType:
    """The extension of `key`, compiled first when its directory holds no build. Raises KernelBuildError."""
    directory = build_directory(key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not is_built(key):
            _build(key, directory)
        with _build_lock(directory, exclusive=False):  # never import a library that a build is still writing
            return _import_built(key, directory)
    except Exception as exc:  # noqa: BLE001 - compiler missing or failing, unloadable library: one clear error
        raise KernelBuildError(f"the CPU kernels ({key.name}) could not be built or loaded: {_cause(exc)}. Install "
                               "a C++ compiler (g++), or run with --enforce-eager for plain torch ops "
                               "(3-5x slower)") from exc


def _build(key: BuildKey, directory: Path) -> None:
    from torch.utils.cpp_extension import load as torch_load

    with _build_lock(directory, exclusive=True):
        if is_built(key):  # another process built it while this one waited
            return
        log.info("building the CPU kernels for %s into %s (about a minute, once per key)",
                 ",".join(key.features) or "no vector ISA", directory)
        (directory / "lock").unlink(missing_ok=True)  # torch's own lock, left behind by a build that was killed
        torch_load(name=key.name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                   extra_ldflags=list(LDFLAGS), build_directory=str(directory), verbose=False)


@contextlib.contextmanager
def _build_lock(directory: Path, exclusive: bool) -> Iterator[None]:
    """One build at a time per key, and no import during a build. An flock ends with the process that holds
    it, so a killed build never blocks the next one (torch's lock file does, for ever)."""
    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


def _import_built(key: BuildKey, directory: Path) -> ModuleType:
    """Imports the built library as a module, without torch's loader, which re-runs ninja with this checkout's
    source paths (rebuilding a build another checkout made) and waits on its lock file."""
    spec = importlib.util.spec_from_file_location(key.name, directory / f"{key.name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cause(exc: Exception) -> str:
    """The first line of the error, and its first compiler error line when there is one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    errors = [line for line in lines[1:] if "error" in line.lower()]
    return "; ".join(lines[:1] + errors[:1])[:400].rstrip(".")


def main() -> int:
    """Build (or find) the extension of this checkout and CPU; exit status 1 when it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    key = build_key()
    try:
        load(key)
    except KernelBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"CPU kernels ready: {build_directory(key)}")
    return 0
