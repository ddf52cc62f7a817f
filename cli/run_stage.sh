#!/bin/sh
# What every dvc.yaml stage runs: `fleetloop stage NAME` on the project's own interpreter.
# DVC runs a stage's cmd with whatever `python` PATH finds first, so `.venv/bin/dvc repro` alone
# would pick the system Python. Order: $FLEETLOOP_PYTHON, the active venv, the repo's .venv, python3.
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "$FLEETLOOP_PYTHON" ]; then py=$FLEETLOOP_PYTHON
elif [ -n "$VIRTUAL_ENV" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then py=$VIRTUAL_ENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3
fi
cd "$root" && exec "$py" -m cli stage "$@"
