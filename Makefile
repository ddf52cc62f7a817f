# fleetloop — two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT := true
# Some hosts (CI among them) set PYTHONDONTWRITEBYTECODE: every process would then recompile every
# module it imports (~30 s for torch + prefect + mlflow + lancedb + dvc). Cleared here, so that the
# first import writes the byte-code and later processes load it.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup demo test bench ui clean deploy

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned exactly, so pip takes the CPU build already on disk instead of a CUDA download
# (uv would not look there). The rest goes in with uv, which downloads and installs in parallel
# (~15 s instead of pip's ~150 s on 2 cores); pip does it where uv cannot. Nothing is
# byte-compiled up front (~80 s for the whole venv on 2 cores): each module is compiled once, on
# its first import, and the suite imports a fraction of the venv.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[test]' || $(BIN)/pip install -q --no-compile -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/fleetloop demo

# Two workers: the suite waits on servers and subprocesses for much of its time (tests/conftest.py
# keeps tests that share a server on one worker). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

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
