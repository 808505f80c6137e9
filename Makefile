# capture-megatron: `make setup` (idempotent), `make demo`, `make test` (what CI runs),
# `make test-fast` (after every change, < 2 min), `make lint` (ruff + mypy), `make test312` (CI's
# second leg: Python 3.12, megatron-core 0.19.2, in .venv312). See CONTRIBUTING.md.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.capture-megatron-installed
PYTEST_ARGS ?=
# tests run on JOBS pytest workers (pytest-xdist): those outside tests/dist and tests/slurm are mostly
# one Python thread each, so 2 workers fill CI's 2 cores; the torchrun and Slurm jobs run a file per
# worker (--dist loadfile: a file's module fixtures are built once; one worker holds the Slurm
# cluster), two jobs at a time filling the cores that one job's start-up and gloo waits leave idle
JOBS   ?= 2
FAST   := not slow and not dist and not slurm and not gpu
# the package's bytecode, written before a run: with PYTHONDONTWRITEBYTECODE set (as on this
# project's machines) every process the tests start (hundreds of torchrun ranks, CLI and
# profiling workers) would otherwise compile the modules it imports again, about 0.14 s each
BYTECODE := $(BIN)/python -m compileall -q capture_megatron
LINTED := capture_megatron tests bench

# CI's second leg: Python 3.12 with megatron-core 0.19.2 (megatron-core 0.17 and newer need 3.12).
# torch for 3.12 comes from the package registry (its CUDA build, which runs on the CPU too).
# setup312 builds the environment a user already has -- torch and megatron-core first -- then
# installs this package into it and fails if that changed either of them.
PYTHON312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' 2>/dev/null \
	&& echo python3.12 || echo "env PYENV_VERSION=3.12.1 python3.12")
VENV312   := .venv312
BIN312    := $(VENV312)/bin
STAMP312  := $(VENV312)/.capture-megatron-installed
MCORE312  ?= 0.19.2
TORCH312  ?= 2.13.0
STACK     := import importlib.metadata as m; print(m.version("megatron-core"), m.version("torch"))

.PHONY: setup demo test test-fast test-dist lint format wheel clean setup312 test312

setup: $(STAMP)

$(STAMP): pyproject.toml
	# the fake CUDA device (the default GPU memory model) compiles a small shim with g++
	command -v g++ >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	    apt-get install -y -qq g++ >/dev/null; } || echo "warning: install g++ for --device fake-cuda"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the default leg's torch (the CPU build on disk) and megatron-core, before the package: its
	# requirements admit 0.16.1 through 0.19.x and never replace what is installed
	$(BIN)/python -m pip install --quiet torch==2.13.0 megatron-core==0.16.1
	# setuptools warns on every editable install that a folder named like the package may shadow it
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(STAMP312): pyproject.toml
	test -x $(BIN312)/python || $(PYTHON312) -m venv $(VENV312)
	$(BIN312)/python -m pip install --quiet --upgrade pip
	$(BIN312)/python -m pip install --quiet torch==$(TORCH312) megatron-core==$(MCORE312)
	$(BIN312)/python -c '$(STACK)' > $(VENV312)/stack-before
	PYTHONWARNINGS=ignore::UserWarning $(BIN312)/python -m pip install --quiet -e '.[dev]'
	$(BIN312)/python -c '$(STACK)' | cmp -s - $(VENV312)/stack-before || { echo "installing \
	capture-megatron changed megatron-core/torch: $$(cat $(VENV312)/stack-before) ->" \
	"$$($(BIN312)/python -c '$(STACK)')"; exit 1; }
	echo "installing capture-megatron kept megatron-core and torch: $$(cat $(VENV312)/stack-before)"
	touch $(STAMP312)

setup312: $(STAMP312)

# the second leg: the fast tests, then a PP-2 GPT and a PP-2 x EP-2 MoE model planned, trained and
# verified on the CPU (tests/dist/test_megatron_core_versions.py: within 1% on every rank)
test312: setup312
	$(BIN312)/python -m compileall -q capture_megatron
	$(BIN312)/capture-megatron --version
	$(BIN312)/python -m pytest -q -n $(JOBS) -m "$(FAST)" tests $(PYTEST_ARGS)
	$(BIN312)/python -m pytest -q -n $(JOBS) --dist loadfile tests/dist/test_megatron_core_versions.py

demo: setup
	$(BIN)/capture-megatron demo

test: setup
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup -m "not dist and not slurm" tests $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m "dist or slurm" tests $(PYTEST_ARGS)

test-fast: setup
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n $(JOBS) -m "$(FAST)" tests $(PYTEST_ARGS)

test-dist: setup
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m dist tests $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix $(LINTED)
	$(BIN)/ruff format $(LINTED)

wheel: setup
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) $(VENV312) build dist *.egg-info
