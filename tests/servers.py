"""Real remote stores for tests, on loopback in a temp dir: Postgres (pgserver's bundled binaries,
on a Unix socket), an S3 API (moto's standalone server) and an ``mlflow server`` process over both.

No mocks: the product talks to these exactly as it would to a team's servers. Each ``start_*``
returns a handle whose ``stop()`` tears the server down; tests use them through the session
fixtures in tests/conftest.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"
S3_KEYS = {"AWS_ACCESS_KEY_ID": "fleetloop-test", "AWS_SECRET_ACCESS_KEY": "fleetloop-test-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}
MLFLOW_START_S = 300.0  # a fresh Postgres store runs MLflow's migrations first: slow on a busy 2-core machine
STOP_GRACE_S = 10.0
ARTIFACT_BUCKET = "fleetloop"
ARTIFACT_PREFIX = "fleetloop-runs"  # registry.artifact_uri = s3://ARTIFACT_BUCKET/ARTIFACT_PREFIX
STORE_PREFIX = "fleetloop-segments"  # store.uri = s3://ARTIFACT_BUCKET/STORE_PREFIX
POLL_S = 0.25


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class Postgres:
    server: object  # pgserver.PostgresServer
    folder: Path

    def uri(self, database: str) -> str:
        return self.server.get_uri(database)

    def create_database(self, name: str) -> str:
        self.server.psql(f"CREATE DATABASE {name};")
        return self.uri(name)

    def query(self, database: str, sql: str) -> list[list[str]]:
        """Rows of ``sql`` run by psql in ``database`` (unaligned, tab-separated)."""
        from pgserver._commands import POSTGRES_BIN_PATH

        out = subprocess.run([str(POSTGRES_BIN_PATH / "psql"), self.uri(database), "-At", "-F", "\t", "-c", sql],
                             check=True, capture_output=True, text=True).stdout
        return [line.split("\t") for line in out.splitlines()]

    def stop(self) -> None:
        self.server.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres() -> Postgres:
    """In its own temp folder, not pytest's: running as root, pgserver runs Postgres as another
    user, which must traverse the folder's parents, and every pytest session resets
    /tmp/pytest-of-<user> to mode 0700."""
    import pgserver

    folder = Path(tempfile.mkdtemp(prefix="fleetloop-postgres-"))
    return Postgres(pgserver.get_server(folder / "pgdata", cleanup_mode="stop"), folder)


@dataclass
class S3:
    server: object  # moto.server.ThreadedMotoServer
    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """What a client needs (boto3 and MLflow read these)."""
        return {**S3_KEYS, "MLFLOW_S3_ENDPOINT_URL": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"], region_name=S3_KEYS["AWS_DEFAULT_REGION"])

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def stop(self) -> None:
        self.server.stop()


def start_s3() -> S3:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3(server, f"http://{host}:{port}")


@dataclass
class MlflowServer:
    process: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        """The whole process group: ``mlflow server`` runs its app in a uvicorn child process."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_mlflow_server(backend_store_uri: str, artifacts_destination: str, env: dict[str, str], folder: Path) -> MlflowServer:
    """``mlflow server`` on a free loopback port, one worker, artifacts proxied to ``artifacts_destination``."""
    port = free_port()
    log = folder / "mlflow-server.log"
    command = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", artifacts_destination, "--host", LOOPBACK, "--port", str(port), "--workers", "1"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env={**os.environ, **env}, cwd=folder, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = MlflowServer(process, f"http://{LOOPBACK}:{port}", log)
    try:
        _wait_healthy(server)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(server: MlflowServer) -> None:
    deadline = time.monotonic() + MLFLOW_START_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"mlflow server exited ({server.process.returncode}); its log: {server.log}\n"
                               f"{server.log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"mlflow server not healthy after {MLFLOW_START_S:.0f} s; its log: {server.log}")


def registry_env(mlflow: MlflowServer, s3: S3, bucket: str = ARTIFACT_BUCKET) -> dict[str, str]:
    """The environment that points fleetloop's registry at these servers (docs: components/registry)."""
    return {"FLEETLOOP_REGISTRY__TRACKING_URI": mlflow.url,
            "FLEETLOOP_REGISTRY__ARTIFACT_URI": f"s3://{bucket}/{ARTIFACT_PREFIX}", **s3.env}


def store_env(s3: S3, prefix: str = STORE_PREFIX, bucket: str = ARTIFACT_BUCKET) -> dict[str, str]:
    """The environment that puts fleetloop's segment store on this S3 (docs: components/store)."""
    return {"FLEETLOOP_STORE__URI": f"s3://{bucket}/{prefix}", "AWS_ENDPOINT_URL": s3.endpoint, **S3_KEYS}


def main() -> None:
    """``python -m tests.servers``: the three servers on loopback until Ctrl-C, with the exports
    that point fleetloop's registry and segment store at them (try the team set-up on one machine)."""
    folder = Path(tempfile.mkdtemp(prefix="fleetloop-servers-"))
    postgres, s3 = start_postgres(), start_s3()
    mlflow = None
    try:
        s3.create_bucket(ARTIFACT_BUCKET)
        mlflow = start_mlflow_server(postgres.create_database("mlflow"), f"s3://{ARTIFACT_BUCKET}/proxied", s3.env, folder)
        print("# Postgres, S3 and an MLflow tracking server run on 127.0.0.1; in another shell:")
        for key, value in {**registry_env(mlflow, s3), **store_env(s3)}.items():
            print(f"export {key}={value}")
        print("# Ctrl-C stops them", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while mlflow.process.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        for server in (mlflow, s3, postgres):
            if server is not None:
                server.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
