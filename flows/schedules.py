"""Schedules: `retrain` on a cron (nightly by default) and `fleet_round` on an interval, from params.

``fleetloop serve`` serves both from this process against a Prefect server; ``prefect.yaml``
declares the same two deployments for a process work pool (``prefect deploy --all``).
"""

from __future__ import annotations

from prefect import serve

from components.config import Settings
from flows.fleet_round import fleet_round
from flows.retrain import retrain

RETRAIN_DEPLOYMENT = "nightly-retrain"
FLEET_ROUND_DEPLOYMENT = "fleet-round"


def deployments(settings: Settings) -> list:
    return [
        retrain.to_deployment(name=RETRAIN_DEPLOYMENT, cron=settings.ops.retrain_cron, tags=["fleetloop"]),
        fleet_round.to_deployment(name=FLEET_ROUND_DEPLOYMENT, interval=settings.ops.fleet_round_interval_s, tags=["fleetloop"]),
    ]


def serve_deployments(settings: Settings) -> None:
    serve(*deployments(settings))
