"""`explain`: the failure explorer for a freshly registered fert version, logged onto its run (explain/)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from components.config import Settings
from components.fert.explorer import Explanation
from components.pipeline import explain as step


@task(name="explain-failures", cache_policy=NO_CACHE)
def explain_task(settings: Settings, version: int) -> Explanation | None:
    return step.explain_candidate(settings, version)
