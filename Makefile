# fleetloop — two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT := true

.PHONY: setup demo test bench ui clean deploy

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned exactly, so pip takes the CPU build already on disk instead of a CUDA download.
# pip byte-compiles one file at a time; compileall does the same on every core (~30 s of 160 s
# less on 2 cores). Its non-zero exit is files for newer Pythons (torch's py312 tests), which pip skips too.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[test]'
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/fleetloop demo

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m benchmarks.run_all

ui: setup
	$(BIN)/fleetloop ui

clean:
	rm -rf $(VENV) .prefect mlruns/mlflow.db mlruns/artifacts artifacts metrics

# Deployments for a process work pool (needs a Prefect server, e.g. `make ui` in another shell).
deploy: setup
	$(BIN)/prefect work-pool create fleetloop-process --type process || true
	FLEETLOOP_REPO=$(CURDIR) $(BIN)/prefect --no-prompt deploy --all
