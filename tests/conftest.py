"""Shared fixtures: real embedded services in temporary folders, no mocks."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Prefect's home and result storage must not leak between sessions (STACK-NOTES).
_PREFECT_TMP = Path(tempfile.mkdtemp(prefix="fleetloop-prefect-"))
os.environ["PREFECT_HOME"] = str(_PREFECT_TMP)
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_PREFECT_TMP / "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("PREFECT_API_URL", None)

# `import dvc` runs dvc.logger.setup(), which binds DVC's log handlers to the sys.stdout/stderr of
# that moment. Imported first inside a test using capsys, they would write to that test's capture
# stream, closed at its teardown, and every later in-process DVC call would raise LoggingException.
import dvc  # noqa: E402, F401

from components.config import (  # noqa: E402
    DemoConfig,
    EvaluationConfig,
    FleetConfig,
    SchedulerConfig,
    Settings,
    TrainConfig,
)

# Tests that start these session servers run on one xdist worker, so each server starts once.
SHARED_SERVER_FIXTURES = frozenset({"s3_server", "postgres_server", "mlflow_server"})
# Modules that start a whole fleet (coordinator, services, trainer, robots) and judge it by timing:
# one at a time, on one worker. Two fleets at once starved each other on 2 cores (a member needed
# more than its 6-s grace to exit, a robot reported late).
WHOLE_FLEET_MODULES = frozenset({"tests/test_fleet_chaos.py", "tests/test_fleet_cli.py", "tests/test_fleet_lifecycle.py"})


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """`make test` runs two xdist workers (`--dist loadgroup`): a module whose tests share an
    expensive fixture (the remote servers, a module-scoped fixture) stays on one worker so the
    fixture is built once, and modules with slow tests are handed out first, so that neither worker
    is left running a long one alone at the end. Without xdist only the order changes."""
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for module, module_items in by_module.items():
        group = _shared_fixture_group(module, module_items)
        for item in module_items if group else ():
            item.add_marker(pytest.mark.xdist_group(group))
    # modules with a slow test first, each module's tests kept together and in order: pytest builds
    # a module-scoped fixture again when its module's tests are split
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in slow)  # stable


def pytest_configure(config):
    """``--dist loadgroup`` under pytest ≥ 9.2 with pytest-xdist ≤ 3.8: xdist groups tests by writing
    ``item._nodeid``, which pytest 9.2 no longer reads, so every xdist_group is silently split
    (servers started twice, two whole fleets at once, module fixtures built on both workers)."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import xdist
    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2") and Version(xdist.__version__) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores xdist_group marks: "
            "install the versions pyproject.toml pins (.venv/bin/pip install -e '.[test]')")


def _shared_fixture_group(module: str, items: list) -> str | None:
    """The xdist group of a test module whose tests share an expensive fixture, else None."""
    if any(SHARED_SERVER_FIXTURES & set(item.fixturenames) for item in items):
        return "remote-servers"
    if module in WHOLE_FLEET_MODULES:
        return "whole-fleets"
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs  # this test's resolved fixtures (pytest internals)
        if any(defs[name][-1].scope == "module" for name in item.fixturenames if defs.get(name)):
            return module
    return None


def pytest_unconfigure(config):
    """The session's Prefect home goes with the session (one was left in /tmp per run)."""
    shutil.rmtree(_PREFECT_TMP, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (~9 s start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield


def small_settings(root: Path, **overrides) -> Settings:
    """A fast configuration in a scratch root: a handful of robots, episodes and epochs."""
    base = dict(
        root=root,
        seed=0,
        device="cpu",
        demo=DemoConfig(expert_robots=2, expert_episodes_per_robot=6, rounds=1),
        fleet=FleetConfig(num_robots=2, num_heldout_robots=2, steps_per_robot=300),
        train=TrainConfig(method="filtered_bc", epochs=3, batch_size=64, steps_per_iteration=10, validation_robots=1),
        evaluation=EvaluationConfig(trials_per_robot=3, trials_per_task=6),
        # a fixed plan: `auto` profiles on first use (tests of it ask for it with small sizes)
        scheduler=SchedulerConfig(plan="sequential"),
    )
    base.update(overrides)
    return Settings(**base)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return small_settings(tmp_path)


# -- remote stores (tests/servers.py): real servers on loopback, one of each per session -------------


@pytest.fixture(scope="session")
def s3_server():
    from tests.servers import ARTIFACT_BUCKET, start_s3

    server = start_s3()
    server.create_bucket(ARTIFACT_BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_server():
    from tests.servers import start_postgres

    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, postgres_server, s3_server):
    """An MLflow tracking server on Postgres whose own artifact default is proxied to S3."""
    from tests.servers import ARTIFACT_BUCKET, start_mlflow_server

    server = start_mlflow_server(postgres_server.create_database("mlflow"), f"s3://{ARTIFACT_BUCKET}/proxied",
                                 s3_server.env, tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.stop()
