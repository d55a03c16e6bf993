# The README's two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megapipe-installed

.PHONY: setup demo test lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below can pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# DEMO_ARGS: e.g. "--set vars.steps=100"; a second `make demo` is a cache hit (megapipe pipeline status shows it)
demo: setup
	$(VENV)/bin/megapipe pipeline run pipelines/tiny-cpu.yaml $(DEMO_ARGS)

test: setup
	$(PY) -m pytest -q -ra

lint: setup
	$(VENV)/bin/ruff check .
