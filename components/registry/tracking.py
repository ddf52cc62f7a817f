"""Where MLflow keeps runs, the registry and artifacts: one ``TrackingStore`` from ``RegistryConfig``.

Default: a SQLite store and artifacts under <root>/mlruns (STACK-NOTES: no file store). A team sets
``registry.tracking_uri`` (a tracking server, e.g. backed by Postgres) and ``registry.artifact_uri``
(e.g. ``s3://bucket/prefix``): then nothing is written under <root>/mlruns. Credentials stay out of
the config: MLflow, boto3 and libpq read them from their own env vars and files. Any URI shown to
people goes through ``redact_uri``.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from components.config import RegistryConfig
from components.registry.local_store import seed_local_db

LOCAL_DB = "mlflow.db"
LOCAL_ARTIFACTS = "artifacts"
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
TRACKING_URI_ENV = "FLEETLOOP_REGISTRY__TRACKING_URI"


class TrackingStoreError(RuntimeError):
    """The tracking store cannot be used; ``problem`` and ``fix`` are one line each, URIs redacted."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; fix: {fix}")
        self.problem = problem
        self.fix = fix


def redact_uri(uri: str) -> str:
    """``uri`` with any password replaced by ``***`` (``postgresql://u:***@host/db``)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def scrub(text: str, uri: str) -> str:
    """``text`` (e.g. a driver's error) with ``uri``'s password taken out."""
    password = urlsplit(uri).password
    return text.replace(uri, redact_uri(uri)).replace(password, "***") if password else text


def split_credentials(uri: str) -> tuple[str, dict[str, str]]:
    """An http(s) tracking URI without its ``user:password@`` and MLflow's env vars for them, so the
    password never travels in the URI MLflow prints (run links) or puts in its errors."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.username is None:
        return uri, {}
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, {"MLFLOW_TRACKING_USERNAME": unquote(parts.username), "MLFLOW_TRACKING_PASSWORD": unquote(parts.password or "")}


@dataclass(frozen=True)
class TrackingStore:
    """The resolved store: what MLflow is pointed at and where new experiments put artifacts."""

    uri: str
    artifact_location: str | None  # None: the tracking server's default
    local_dir: Path | None  # <root>/mlruns when the store is the embedded default, else None

    @property
    def shown(self) -> str:
        return redact_uri(self.uri)

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """host and port to probe, or None for a store without one (SQLite, a Unix socket)."""
        parts = urlsplit(self.uri)
        scheme = parts.scheme.split("+")[0]
        if not parts.hostname or scheme not in DEFAULT_PORTS:
            return None
        return parts.hostname, parts.port or DEFAULT_PORTS[scheme]


def tracking_store(mlruns: Path, cfg: RegistryConfig) -> TrackingStore:
    if not cfg.tracking_uri:
        artifacts = cfg.artifact_uri or (mlruns / LOCAL_ARTIFACTS).resolve().as_uri()
        return TrackingStore(f"sqlite:///{(mlruns / LOCAL_DB).resolve()}", artifacts, mlruns)
    return TrackingStore(cfg.tracking_uri, cfg.artifact_uri or None, None)


def tracking_uri(mlruns: Path, cfg: RegistryConfig) -> str:
    return tracking_store(mlruns, cfg).uri


def check_reachable(store: TrackingStore, timeout_s: float) -> None:
    """Fail fast (one line, redacted) when the store's host does not answer: MLflow itself retries a
    missing server or database for minutes before it gives up."""
    if store.endpoint is None:
        return
    try:
        socket.create_connection(store.endpoint, timeout=timeout_s).close()
    except OSError as exc:
        raise TrackingStoreError(
            f"MLflow tracking store {store.shown} is not reachable ({type(exc).__name__}: {exc})",
            f"start the tracking server (or database), or point {TRACKING_URI_ENV} at one that runs",
        ) from None


def configure_mlflow(mlruns: Path, cfg: RegistryConfig) -> str:
    """Point MLflow at the configured store and make sure the experiment exists; returns its id."""
    store = tracking_store(mlruns, cfg)
    check_reachable(store, cfg.connect_timeout_s)
    level = logging.getLogger().level
    import mlflow  # noqa: PLC0415 - heavy import kept off module import

    logging.getLogger().setLevel(level)  # `import mlflow.pytorch` resets root logging (STACK-NOTES)
    if store.local_dir is not None:
        store.local_dir.mkdir(parents=True, exist_ok=True)
        seed_local_db(store.local_dir / LOCAL_DB, store.artifact_location or store.local_dir.resolve().as_uri())
    uri, credentials = split_credentials(store.uri)
    os.environ.update(credentials)  # MLflow reads a server's basic-auth credentials from env only
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        return _experiment_id(mlflow, cfg, store)
    except TrackingStoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - MlflowException, a driver's error: one line, redacted
        first_line = scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, store.uri)
        raise TrackingStoreError(
            f"MLflow tracking store {store.shown} refused experiment {cfg.experiment!r}: {first_line}",
            f"check the server's logs and {TRACKING_URI_ENV}; credentials come from MLFLOW_TRACKING_USERNAME/"
            "MLFLOW_TRACKING_PASSWORD (server) or ~/.pgpass (database)",
        ) from None


def _experiment_id(mlflow, cfg: RegistryConfig, store: TrackingStore) -> str:
    """The experiment's id, created with ``store.artifact_location`` when new; with
    ``registry.artifact_uri`` set, an existing one must already keep its artifacts there (MLflow
    never moves an experiment's artifact root)."""
    name, wanted = cfg.experiment, cfg.artifact_uri
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        return mlflow.create_experiment(name, artifact_location=store.artifact_location)
    if wanted and experiment.artifact_location.rstrip("/") != wanted.rstrip("/"):
        raise TrackingStoreError(
            f"experiment {name!r} on {store.shown} keeps its artifacts at {redact_uri(experiment.artifact_location)}, "
            f"not registry.artifact_uri={redact_uri(wanted)}",
            "use a new registry.experiment for the new artifact root, or set registry.artifact_uri to the existing one",
        )
    return experiment.experiment_id
