# The two quickstart targets (`make demo`, `make test`) work on a fresh machine: they create
# .venv, install the local CPU build of torch first, then the package with its dev extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint typecheck clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/hexagram demo

lint: setup
	$(BIN)/ruff check hexagram tests benchmarks examples
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
