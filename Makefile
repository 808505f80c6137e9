# capture-megatron: `make setup` (idempotent), `make demo`, `make test` (what CI runs),
# `make test-fast` (after every change, < 2 min), `make lint` (ruff + mypy). See CONTRIBUTING.md.
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

.PHONY: setup demo test test-fast test-dist lint format wheel clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	# the fake CUDA device (the default GPU memory model) compiles a small shim with g++
	command -v g++ >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	    apt-get install -y -qq g++ >/dev/null; } || echo "warning: install g++ for --device fake-cuda"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# setuptools warns on every editable install that a folder named like the package may shadow it
	PYTHONWARNINGS=ignore::UserWarning $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

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
	rm -rf $(VENV) build dist *.egg-info
