# capture-megatron: `make setup` (idempotent), `make demo`, `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.capture-megatron-installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-dist clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/capture-megatron demo

test: setup
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

test-dist: setup
	$(BIN)/python -m pytest -q tests/dist $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
