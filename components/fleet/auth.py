"""Per-robot bearer tokens, revocation, and a logging filter that keeps tokens out of every log.

Tokens come from the token file under the root (``runtime.token_file``, mode 0600, written by
``issue_tokens``) and/or the ``runtime.tokens`` secret (env ``FLEETLOOP_RUNTIME__TOKENS``, JSON
``{"robot-0000": "token"}``); never from the repository. Services keep only SHA-256 digests in
memory for lookups and re-read the file when it changes, so a revocation takes effect at once.

Rules: no or unknown token -> 401; a revoked token -> 403; a robot token is one robot (it may
upload only its own episodes and read the policy); the service token is for the runtime's own
processes and admin reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from components.fsio import atomic_write_bytes

ROBOT = "robot"
SERVICE = "service"
SERVICE_NAME = "fleet-service"
TOKEN_BYTES = 32
TOKEN_FILE_MODE = 0o600
REDACTED = "[REDACTED]"
# Any bearer credential, header-style or key=value style, is redacted even if it is not ours.
# (credential-like values only: 8+ token characters, so prose such as "bearer token" survives)
_CREDENTIAL = r"(?!bearer\b)[A-Za-z0-9._~+/=-]{8,}"
_BEARER = re.compile(r"(?i)(bearer\s+)" + _CREDENTIAL)
_KEYED = re.compile(r"(?i)((?:token|authorization|api[_-]?key)[\"']?\s*[:=]\s*[\"']?)" + _CREDENTIAL)


class AuthError(Exception):
    """A request that may not proceed: ``status`` is 401 (who are you?) or 403 (not allowed)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Principal:
    """Who a valid token belongs to."""

    name: str  # robot id, or SERVICE_NAME
    role: str  # ROBOT | SERVICE


@dataclass(frozen=True)
class TokenFile:
    """The token file's content: plaintext tokens (the file is 0600) and revoked digests."""

    robots: dict[str, str] = field(default_factory=dict)
    service: str = ""
    revoked: tuple[str, ...] = ()
    revoked_robots: tuple[str, ...] = ()  # ids that get no new token until re-admitted

    def to_json(self) -> bytes:
        body = {"robots": self.robots, "service": self.service, "revoked": list(self.revoked),
                "revoked_robots": list(self.revoked_robots)}
        return json.dumps(body, indent=2, sort_keys=True).encode()


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def read_token_file(path: Path) -> TokenFile:
    """Parse the token file; a missing file is an empty book."""
    path = Path(path)
    if not path.exists():
        return TokenFile()
    try:
        raw = json.loads(path.read_text())
        robots = {str(k): str(v) for k, v in dict(raw.get("robots", {})).items()}
        return TokenFile(robots, str(raw.get("service", "")), tuple(str(d) for d in raw.get("revoked", [])),
                         tuple(str(r) for r in raw.get("revoked_robots", [])))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{path}: not a fleet token file ({type(exc).__name__}); "
            "recreate it with `fleetloop fleet tokens` (fields: robots, service, revoked, revoked_robots)"
        ) from None


def issue_tokens(path: Path, robot_ids: Iterable[str], rotate: bool = False,
                 readmit: Iterable[str] = ()) -> TokenFile:
    """Give every robot (and the runtime's services) a token; keeps existing ones unless ``rotate``.

    Rotated tokens are revoked, so a leaked old token is refused with 403. A revoked robot gets no
    new token (a later ``fleet up`` or ``fleet tokens`` must not undo a revoke) unless it is in
    ``readmit``.
    """
    book = read_token_file(path)
    robots = dict(book.robots)
    revoked = list(book.revoked)
    readmit = set(readmit)
    barred = tuple(r for r in book.revoked_robots if r not in readmit)
    for robot_id in robot_ids:
        if robot_id in barred:
            continue
        if robot_id in robots and rotate:
            revoked.append(token_digest(robots[robot_id]))
        if robot_id not in robots or rotate:
            robots[robot_id] = new_token()
    service = book.service
    if not service or rotate:
        if service:
            revoked.append(token_digest(service))
        service = new_token()
    updated = TokenFile(robots, service, tuple(dict.fromkeys(revoked)), barred)
    atomic_write_bytes(Path(path), updated.to_json(), mode=TOKEN_FILE_MODE)
    return updated


def revoke_robot(path: Path, robot_id: str) -> TokenFile:
    """Revoke a robot's token (its requests get 403 from now on) and drop it from the file."""
    book = read_token_file(path)
    if robot_id not in book.robots:
        if robot_id in book.revoked_robots:
            raise KeyError(f"{path}: robot {robot_id!r} is already revoked; "
                           f"`fleetloop fleet tokens --readmit {robot_id}` gives it a new token")
        raise KeyError(f"{path}: robot {robot_id!r} has no token; `fleetloop fleet status` lists the fleet")
    robots = {k: v for k, v in book.robots.items() if k != robot_id}
    revoked = tuple(dict.fromkeys((*book.revoked, token_digest(book.robots[robot_id]))))
    updated = TokenFile(robots, book.service, revoked, tuple(dict.fromkeys((*book.revoked_robots, robot_id))))
    atomic_write_bytes(Path(path), updated.to_json(), mode=TOKEN_FILE_MODE)
    return updated


def parse_env_tokens(secret: SecretStr) -> dict[str, str]:
    """``runtime.tokens``: JSON ``{"robot-id": "token"}`` (the key ``service`` names the service token)."""
    value = secret.get_secret_value().strip()
    if not value:
        return {}
    try:
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError
    except ValueError:
        raise ValueError(
            'FLEETLOOP_RUNTIME__TOKENS must be a JSON object {"robot-0000": "<token>", ...}'
        ) from None
    return {str(k): str(v) for k, v in parsed.items()}


class TokenBook:
    """Authenticates bearer tokens against the token file (re-read on change) and env tokens."""

    def __init__(self, token_file: Path, env_tokens: SecretStr = SecretStr("")) -> None:
        self.path = Path(token_file)
        self._env = parse_env_tokens(env_tokens)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._by_digest: dict[str, Principal] = {}
        self._revoked: frozenset[str] = frozenset()
        self._plain: tuple[str, ...] = ()
        self._reload()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _reload(self) -> None:
        stamp = self._file_stamp()
        book = read_token_file(self.path)
        by_digest: dict[str, Principal] = {}
        plain: list[str] = []
        entries = list(book.robots.items()) + list(self._env.items())
        for name, token in entries:
            role = SERVICE if name == SERVICE else ROBOT
            by_digest[token_digest(token)] = Principal(SERVICE_NAME if role == SERVICE else name, role)
            plain.append(token)
        if book.service:
            by_digest[token_digest(book.service)] = Principal(SERVICE_NAME, SERVICE)
            plain.append(book.service)
        self._by_digest = by_digest
        self._revoked = frozenset(book.revoked)
        self._plain = tuple(plain)
        self._stamp = stamp

    def refresh(self) -> None:
        """Re-read the token file if it changed since the last look (cheap: one stat)."""
        if self._file_stamp() != self._stamp:
            with self._lock:
                if self._file_stamp() != self._stamp:
                    self._reload()

    def secrets(self) -> tuple[str, ...]:
        """Every token value known (for log redaction only)."""
        return self._plain

    def authenticate(self, authorization: str | None) -> Principal:
        """``Authorization`` header value -> Principal, or AuthError (401/403)."""
        self.refresh()
        if not authorization:
            raise AuthError(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(401, "malformed Authorization header: expected 'Bearer <token>'")
        digest = token_digest(token)
        if digest in self._revoked:
            raise AuthError(403, "token revoked: ask the operator for a new one")
        principal = self._by_digest.get(digest)
        if principal is None:
            raise AuthError(401, "unknown token")
        return principal

    def require(self, authorization: str | None, roles: Iterable[str]) -> Principal:
        principal = self.authenticate(authorization)
        allowed = tuple(roles)
        if principal.role not in allowed:
            raise AuthError(403, f"a {principal.role} token may not call this endpoint (needs {'/'.join(allowed)})")
        return principal


def redact(text: str, known: Iterable[str] = ()) -> str:
    """Replace bearer credentials and every known token value with ``[REDACTED]``."""
    for token in known:
        if token and token in text:
            text = text.replace(token, REDACTED)
    text = _BEARER.sub(lambda m: m.group(1) + REDACTED, text)
    return _KEYED.sub(lambda m: m.group(1) + REDACTED, text)


class RedactTokens(logging.Filter):
    """Rewrites each record's message (and traceback) with tokens redacted; never drops a record."""

    def __init__(self, known: Callable[[], Iterable[str]] = tuple) -> None:
        super().__init__()
        self.known = known

    def filter(self, record: logging.LogRecord) -> bool:
        known = tuple(self.known())
        message = record.getMessage()
        record.msg, record.args = redact(message, known), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, known)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, known)
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


def configure_logging(
    known: Callable[[], Iterable[str]] = tuple, level: int = logging.INFO, log_file: Path | None = None
) -> RedactTokens:
    """Root logging for a fleet process: one stderr (and optional file) handler, tokens redacted.

    Filters sit on the handlers, so records propagated from any logger (uvicorn, httpx, ours)
    pass through redaction before they are written.
    """
    redactor = RedactTokens(known)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.addFilter(redactor)
        root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "httpx", "httpcore"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # one line per request from clients that talk every control step is noise, not signal
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return redactor


def token_for(name: str, token_file: Path, env_tokens: SecretStr = SecretStr("")) -> str:
    """The token a runtime process presents: a robot's own, or the service token (``name=SERVICE``)."""
    env = parse_env_tokens(env_tokens)
    if name in env:
        return env[name]
    book = read_token_file(token_file)
    token = book.service if name == SERVICE else book.robots.get(name, "")
    if not token:
        raise KeyError(f"no token for {name!r} in {token_file} or FLEETLOOP_RUNTIME__TOKENS; run `fleetloop fleet tokens`")
    return token
