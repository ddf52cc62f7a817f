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

.PHONY: setup system demo test bench ui clean deploy lock compat

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned exactly, so pip takes the CPU build already on disk instead of a CUDA download
# (uv would not look there). The rest goes in with uv, which downloads and installs in parallel
# (~15 s instead of pip's ~150 s on 2 cores); pip does it where uv cannot. Nothing is
# byte-compiled up front (~80 s for the whole venv on 2 cores): each module is compiled once, on
# its first import, and the suite imports a fraction of the venv.
# requirements.lock pins every package under ours to what the last green CI ran (torch excepted: it
# is pinned above, and the CPU build on disk is not on the index), as constraints, so a fresh clone
# installs what CI tested. `make lock` refreshes it after a change to pyproject.toml.
$(STAMP): pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(BIN)/uv pip install -q --python $(BIN)/python -c requirements.lock -e '.[test]' || $(BIN)/pip install -q --no-compile -c requirements.lock -e '.[test]'
	touch $(STAMP)

# Re-resolves requirements.lock from pyproject.toml (after a dependency change there), keeping every
# version the venv already has; `make lock FRESH=1` takes the newest versions that fit instead. Run
# `make test` on the new lock before committing it.
lock: | $(BIN)/python
	$(BIN)/pip install -q --no-compile torch==2.13.0 uv
	$(BIN)/uv pip freeze --python $(BIN)/python | grep -v -e '^-e' -e '^torch==' > $(VENV)/lock-constraints.txt
	$(BIN)/uv pip compile -q pyproject.toml --extra test --python-version 3.11 --no-emit-package torch \
		$(if $(FRESH),--upgrade,-c $(VENV)/lock-constraints.txt) -o requirements.lock

# Meta-World renders its cameras offscreen through MuJoCo's OSMesa (sim.camera.mujoco_gl: osmesa):
# Debian's libosmesa6, installed here when it is missing and this user may (root, as CI); otherwise
# the command to run is printed and everything but Meta-World's cameras works.
system:
	@ldconfig -p | grep -q libOSMesa || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libosmesa6 >/dev/null; \
	  else echo "make setup: Meta-World's cameras need OSMesa: sudo apt-get install libosmesa6"; fi; }

setup: system $(STAMP)

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

# LeRobot's own Python (3.12; LeRobot 0.5 and newer need it): a venv of its own with PyPI's torch
# (a CUDA build, several GB: not run by CI), our package and LeRobot 0.6.1, where LeRobot's ranges
# yield to our pins (tests/compat/overrides.txt). Runs the CPU tests that touch LeRobot's formats, then
# tests/compat/lerobot_round_trip.py (LeRobot writes, fleetloop imports/retrains/exports, LeRobot reads).
COMPAT_PYTHON ?= /root/.pyenv/versions/3.12.1/bin/python3.12
COMPAT_VENV   := .venv-compat
COMPAT_TESTS  ?= tests/test_lerobot.py tests/test_video.py tests/test_cameras.py tests/test_episodes.py

$(COMPAT_VENV)/.installed: pyproject.toml tests/compat/overrides.txt
	rm -rf $(COMPAT_VENV)
	$(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip uv
	$(COMPAT_VENV)/bin/uv pip install --python $(COMPAT_VENV)/bin/python --override tests/compat/overrides.txt \
		torch==2.13.0 -e '.[test]' 'lerobot[dataset]==0.6.1'
	touch $@

compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider -n 0 $(COMPAT_TESTS)
	$(COMPAT_VENV)/bin/python tests/compat/lerobot_round_trip.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .prefect mlruns/mlflow.db mlruns/artifacts artifacts metrics

# Deployments for a process work pool (needs a Prefect server, e.g. `make ui` in another shell).
deploy: setup
	$(BIN)/prefect work-pool create fleetloop-process --type process || true
	FLEETLOOP_REPO=$(CURDIR) $(BIN)/prefect --no-prompt deploy --all
