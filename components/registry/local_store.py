"""A new local MLflow store starts as a copy of an empty, already migrated database.

MLflow creates a SQLite store by running every schema migration (~1.6 s on a 2-core laptop), and
every scratch root pays it: each test, each benchmark cell, each `FLEETLOOP_ROOT=/tmp/x` run. The
migrated empty database is the same file each time for one MLflow + SQLAlchemy, so it is built
once per machine (under the user cache) and copied. MLflow then finds the schema current and only
checks it. The copy is created next to the target and linked into place, so two processes seeding
the same root at once end with one database, and a root that already has one is never touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT_ID = 0  # MLflow's "Default" experiment, created with the schema


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleetloop"


def seed_local_db(db: Path, artifact_root: str) -> bool:
    """Create ``db`` from the migrated template unless it exists; True when seeded. Any failure
    (no writable cache, an unexpected schema) leaves ``db`` absent: MLflow then creates it itself."""
    if db.exists():
        return False
    tmp = db.with_name(f".{db.name}.{os.getpid()}.seed")
    try:
        shutil.copyfile(empty_db_template(), tmp)
        with sqlite3.connect(tmp) as conn:  # MLflow's own default would point at ./mlruns of the cwd
            conn.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                         (f"{artifact_root.rstrip('/')}/{DEFAULT_EXPERIMENT_ID}", DEFAULT_EXPERIMENT_ID))
        conn.close()
        os.link(tmp, db)  # create-if-absent, atomically
        return True
    except FileExistsError:
        return False  # another process seeded it first
    except Exception as exc:  # noqa: BLE001 - OSError, sqlite3.Error, MlflowException: MLflow creates it instead
        log.info("MLflow store %s not seeded from the template (%s); MLflow creates it", db, exc)
        return False
    finally:
        tmp.unlink(missing_ok=True)


def empty_db_template() -> Path:
    """The migrated empty database for the installed MLflow and SQLAlchemy (built on first use)."""
    import mlflow
    import sqlalchemy
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = cache_dir()
    path = folder / f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}-empty.db"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", (folder / "unused-artifacts").as_uri())
        store.engine.dispose()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
