# The two quickstart targets (`make demo`, `make test`) work on a fresh machine: they create
# .venv, install the local CPU build of torch first, then the package with its optional
# extras (data, planner, bench, integrations: see pyproject.toml), the dev tools and the
# documentation tools. `make test` builds the documentation first (warnings are errors).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup data demo docs test lint clean gpu-check

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[all,dev,integrations,docs]"
	@$(MAKE) --no-print-directory data
	touch $(STAMP)

# Fashion-MNIST ships as a Debian package; without it the demo and tests fall back to
# scikit-learn's bundled digits (and say so).
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1) || \
	    echo "note: could not install dataset-fashion-mnist; using scikit-learn's digits"; \
	  else echo "note: run 'apt-get install dataset-fashion-mnist' as root for Fashion-MNIST"; fi; \
	fi

setup: $(STAMP)

demo: setup
	$(BIN)/hexagram demo

lint: setup
	$(BIN)/ruff check hexagram tests benchmarks examples
	$(BIN)/mypy

# the site (docs/), with warnings as errors; the optional frameworks are mocked for autodoc
docs: setup
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html

test: lint docs
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The one-GPU check (scripts/gpu_check.py): staged parts, a report in $(GPU_REPORT). It runs
# with the project's .venv where there is one, else with whatever Python has torch (a GPU
# machine's own; no install): `make gpu-check GPU_PY=/path/to/python`.
GPU_REPORT ?= gpu-report
GPU_PARTS ?= all
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
gpu-check:
	PYTHONPATH=. $(GPU_PY) scripts/gpu_check.py $(GPU_PARTS) --out $(GPU_REPORT)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache docs/_build
