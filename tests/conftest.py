from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import sys
import weakref

import pytest

from engine.disk_cache import ROOT_ENV
from tests import leaks
from tests.server_utils import wait_until
from tests.tiers import Tier, TierError, module_tiers, tier_of, tier_selector

# torch (and tests.tiny_models, which imports it) is imported by the functions that use it: pytest-xdist's
# controller loads this file too, runs no test, and would spend 1.7 s importing torch before it starts a worker.


# The tests allocate many short-lived objects over a heap of torch, transformers and the product's modules; at
# Python's default (700, 10, 10) the cyclic collector re-walks that heap every few hundred allocations. A larger
# young generation, and what collection imported frozen out of the collector's walks, shorten both tiers
# (measured in docs/performance.md, "Test tiers"). Reference counting still frees most objects at once.
GC_YOUNG_THRESHOLD = 20_000
# Modules by their slowest tier: those that start processes, then those that run engines, then the unit ones.
START_ORDER = (Tier.PROCESS, Tier.ENGINE, Tier.UNIT)


def worker_thread_share() -> int | None:
    """Under pytest-xdist (`make test-fast` runs `-n auto`), each worker's share of the cores for torch's threads;
    None when the tests run in one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


def pytest_configure(config):
    """Each xdist worker takes its share of the cores, so that the workers do not oversubscribe the machine, and a
    temporary directory of its own (tests/leaks.py), before any test module is collected; and the collector its
    larger young generation."""
    leaks.use_worker_tmpdir(os.environ.get("PYTEST_XDIST_WORKER"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(end_worker_without_finalising)  # runs after the handlers that imports register later
    share = worker_thread_share()
    if share:
        import torch

        torch.set_num_threads(share)
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


def end_worker_without_finalising() -> None:
    """A pytest-xdist worker's last step, once its results are with the controller: finalising the interpreter
    would free torch's and the tests' heap object by object (about 1 s), which the whole run waits for. What the
    exit handlers registered before this one would do that matters is done here: the finalizers marked for exit
    (temporary directories), multiprocessing's children joined, the log handlers flushed."""
    weakref.finalize._exitfunc()  # each runs at most once, whichever handler calls it first
    if "multiprocessing.util" in sys.modules:
        sys.modules["multiprocessing.util"]._exit_function()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pytest_collection_finish(session):
    """What collection imported (torch, the product, the test modules) stays for the run: out of the collector's
    walks from here on."""
    gc.freeze()


@pytest.fixture(autouse=True)
def worker_threads():
    """Every test starts from its worker's share of threads, whatever an earlier test of the worker set (a bench's
    `main` or an engine built with `num_threads`): two OpenMP teams on one core wait on each other's barriers,
    which made tiny-model steps tens of times slower for the rest of that worker's tests. Tests that need a
    thread count set their own."""
    import torch

    share = worker_thread_share()
    if share and torch.get_num_threads() != share:
        torch.set_num_threads(share)
    yield


def pytest_ignore_collect(collection_path, config):
    """Under a `-m` of tiers alone (`make test-fast`), a module none of whose tests it selects is not imported: the
    process tier's modules bring the official clients and servers' imports, seconds a worker for nothing."""
    selects = tier_selector(config.option.markexpr or "")
    if selects is None or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    tiers = module_tiers(collection_path.name, collection_path.read_text())
    return True if tiers is not None and not any(map(selects, tiers)) else None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers given here
def pytest_collection_modifyitems(config, items):
    """Give every test its tier marker (tests/tiers.py); a test without exactly one tier stops the run. Then put
    the modules in START_ORDER of their slowest tier, each module's tests kept together: the workers take tests
    (`make test`: whole modules, `--dist loadfile --no-loadscope-reorder`) in this order, so the long ones start
    early and the many short unit tests even out the workers' ends."""
    problems, tiers = [], {}
    for item in items:
        try:
            tier = tier_of(item.path.name, (m.name for m in item.iter_markers()))
        except TierError as exc:
            problems.append(f"{item.nodeid}: {exc}")
            continue
        item.add_marker(getattr(pytest.mark, tier.value))
        tiers.setdefault(item.path, set()).add(tier)
    if problems:
        raise pytest.UsageError("\n".join(["tests without exactly one tier:"] + problems))
    items.sort(key=lambda item: min(map(START_ORDER.index, tiers[item.path])))  # stable: modules stay whole


@pytest.fixture(scope="session", autouse=True)
def session_cache_root(tmp_path_factory):
    """What engines cache on disk (engine/disk_cache.py) goes under the test run's own directory, never the user's
    ~/.cache: PHASE_SERVE_CACHE_DIR sets the default root, and every process the tests start inherits it. One root
    for the whole run, as on a machine: a model's kernel dispatch table, converted weights and calibration are
    measured once and reused by every later start, so the modules neither pay them again nor run different
    kernels for the same model. A test that watches a first measurement gives its own directory or
    `--recalibrate`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROOT_ENV, str(tmp_path_factory.mktemp("cache-session")))
        yield


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(request):
    """A module whose tests start processes leaves nothing in /tmp or /dev/shm once they are gone: no socket
    directory, no shared-memory pool, no file. Processes exit a moment after their test, so this waits (up to a
    hang guard) for their entries to go before it names what stayed. Whatever stayed is then removed, so the
    next module is judged on its own."""
    if not _starts_processes(request):
        yield
        return
    before = leaks.entries()
    descendants = leaks.Descendants() if os.environ.get("PYTEST_XDIST_WORKER") else None
    with descendants or contextlib.nullcontext():
        yield
    ours = descendants.ours if descendants else lambda path: True
    if not wait_until(lambda: not leaks.left_since(before, ours), 10):
        left = sorted(map(str, leaks.left_since(before, ours)))
        for path in left:
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        pytest.fail(f"{request.path.name} left {left} behind", pytrace=False)


def _starts_processes(request) -> bool:
    """Whether any test of the module is of the process tier (marked at collection, above)."""
    return any(item.get_closest_marker("process") for item in request.session.items if item.path == request.path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama with grouped-query attention and the tiny BPE tokenizer (vocab 512)."""
    from tests.tiny_models import tiny_llama_config, write_tiny_model

    config = tiny_llama_config(num_key_value_heads=2, max_position_embeddings=1024)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), config, seed=7)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory):
    """Another random model with the tiny model's vocabulary: a poor but valid draft."""
    from tests.tiny_models import tiny_llama_config, write_tiny_model

    config = tiny_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                               max_position_embeddings=1024)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-draft"), config, seed=99)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second OpenMP thread, and lose a lot when the cores are shared (and an
    in-process draft must compute as a one-thread draft actor does). Use with pytest.mark.usefixtures."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def hf_gguf_model():
    """transformers' own GGUF loading of the default model (fp32): the oracle for the loader and the model."""
    import torch

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from engine.model.gguf_loader import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()
