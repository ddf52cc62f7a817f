"""Where the segment store lives: a local folder (the default, under the root) or an object store
(``store.uri = s3://bucket/prefix``), and what LanceDB is told to reach it.

Credentials never pass through fleetloop: LanceDB's object store reads ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and ``AWS_ENDPOINT_URL`` from the
environment itself (as boto3 and DVC do). fleetloop reads only the endpoint, to name it in errors
and to allow plain HTTP when the endpoint is an ``http://`` one (a MinIO or moto server on a LAN).
The options it passes are the bounds on how long a store that does not answer is retried
(``store.connect_timeout_s``, ``store.retry_timeout_s``, ``store.max_retries``): without them
LanceDB retries an unreachable store for up to 3 minutes per request.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pyarrow import fs

from components.config import StoreConfig

# the endpoint variables LanceDB's S3 client reads (object_store's aliases), in its order
ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")
STORE_URI_ENV = "FLEETLOOP_STORE__URI"
REASON_MAX_CHARS = 200  # an error's reason beyond this is cut (LanceDB's errors run to kilobytes)


class SegmentStoreError(RuntimeError):
    """The segment store cannot be used; ``problem`` and ``fix`` are one line each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class StoreLocation:
    """The store's URI (a local folder or ``scheme://bucket/prefix``), the object-store endpoint
    it goes through ("" = the provider's default or a local folder) and LanceDB's storage options
    (timeouts and retries only: no secrets, safe to log)."""

    uri: str
    endpoint: str = ""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return bool(urlsplit(self.uri).scheme) and not Path(self.uri).is_absolute()

    @property
    def local_path(self) -> Path | None:
        return None if self.remote else Path(self.uri)

    @property
    def storage_options(self) -> dict[str, str] | None:
        """What ``lancedb.connect`` gets (None for a local folder: LanceDB's defaults)."""
        return dict(self.options) if self.remote else None

    @property
    def shown(self) -> str:
        """The URI as people may see it (a ``user:password@`` in it is redacted)."""
        parts = urlsplit(self.uri)
        if parts.password is None:
            return self.uri
        return self.uri.replace(f":{parts.password}@", ":***@", 1)

    def __str__(self) -> str:
        return self.shown

    def table_uri(self, table: str) -> str:
        """Where LanceDB keeps ``table``: ``<uri>/<table>.lance``."""
        return f"{self.uri.rstrip('/')}/{table}.lance"

    def unreachable(self, exc: BaseException) -> SegmentStoreError:
        """The one-line error for a store that did not answer (or refused us) at open."""
        endpoint = self.endpoint or "the provider's default"
        return SegmentStoreError(
            f"segment store {self.shown} unreachable (endpoint {endpoint}): {error_reason(exc)}",
            f"check {ENDPOINT_ENV[0]} / credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or set "
            f'store.uri="" ({STORE_URI_ENV}) for the local store under the root',
        )


def store_location(default: Path, cfg: StoreConfig, environ: Mapping[str, str] = os.environ) -> StoreLocation:
    """``cfg.uri``, or ``default`` (``<root>/datasets/segments.lance``) when it is empty."""
    if not cfg.uri:
        return StoreLocation(str(default))
    if Path(cfg.uri).is_absolute():
        return StoreLocation(cfg.uri)
    endpoint = next((environ[key] for key in ENDPOINT_ENV if environ.get(key)), "")
    options = {
        "connect_timeout": f"{math.ceil(cfg.connect_timeout_s * 1000)}ms",
        "client_retry_timeout": str(math.ceil(cfg.retry_timeout_s)),  # whole seconds
        "client_max_retries": str(cfg.max_retries),
    }
    if urlsplit(endpoint).scheme == "http":
        options["allow_http"] = "true"
    return StoreLocation(cfg.uri, endpoint, options)


def error_reason(exc: BaseException) -> str:
    """The useful part of a LanceDB/object-store error, on one line: its innermost OS message
    (``Connection refused``), else the S3 error code (``NoSuchBucket``), else its first line."""
    text = str(exc)
    messages = re.findall(r'message: "([^"]+)"', text)
    if messages:
        return messages[-1]
    code = re.search(r"<Code>([^<]+)</Code>", text)
    if code:
        return code.group(1)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:REASON_MAX_CHARS]


def table_bytes(location: StoreLocation, table: str) -> int:
    """Bytes under the table's folder or prefix: every version's data, indexes and manifests
    (LanceDB's own ``stats()`` counts only the current version's data). An object store is
    listed through pyarrow, which reads the same AWS_* environment as LanceDB."""
    path = location.local_path
    if path is not None:
        root = path / f"{table}.lance"
        return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(root) for name in names)
    filesystem, prefix = _object_filesystem(location.table_uri(table), location.endpoint)
    listing = filesystem.get_file_info(fs.FileSelector(prefix, recursive=True, allow_not_found=True))
    return sum(info.size for info in listing if info.type == fs.FileType.File)


def _object_filesystem(uri: str, endpoint: str) -> tuple[fs.FileSystem, str]:
    """pyarrow's filesystem for ``uri`` and the path in it; an S3 one through ``endpoint`` when
    set (pyarrow reads keys and region from the environment, but not every endpoint variable)."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not endpoint:
        return fs.FileSystem.from_uri(uri)
    server = urlsplit(endpoint)
    return fs.S3FileSystem(endpoint_override=server.netloc, scheme=server.scheme or "https"), parts.netloc + parts.path
