"""`python -m cli ...` is `fleetloop ...` (what `dvc.yaml` stages run)."""

from cli.main import entry

entry()
