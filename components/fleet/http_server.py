"""What every fleet service shares: auth as a FastAPI dependency, body size limits, errors, uvicorn.

Errors are JSON ``{"detail": {"field", "reason", "fix"}}`` so a client (or a person reading a
robot's log) can see what was wrong and what to do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from components.config.operations import FleetRuntimeConfig
from components.fleet.auth import AuthError, Principal, TokenBook
from components.fleet.health import HealthProblem

log = logging.getLogger(__name__)
HEALTH_PATH = "/healthz"
# No /docs, /redoc or /openapi.json: they would answer without a token (the API is in the README).
NO_API_DOCS = {"docs_url": None, "redoc_url": None, "openapi_url": None}


def http_error(status: int, field: str, reason: str, fix: str) -> HTTPException:
    return HTTPException(status_code=status, detail={"field": field, "reason": reason, "fix": fix})


def auth_dependency(book: TokenBook, roles: Iterable[str]) -> Callable[[Request], Awaitable[Principal]]:
    """A FastAPI dependency: the caller's Principal, or 401/403 before the handler runs."""
    allowed = tuple(roles)

    async def dependency(request: Request) -> Principal:
        try:
            return book.require(request.headers.get("authorization"), allowed)
        except AuthError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            log.warning("refused %s %s: %s", request.method, request.url.path, exc.reason)
            raise HTTPException(
                exc.status, {"field": "Authorization", "reason": exc.reason, "fix": "use this robot's own token"}, headers
            ) from None

    return dependency


async def read_body_limited(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over ``max_bytes`` declared or streamed."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise http_error(400, "Content-Length", f"not a number: {declared[:32]!r}", "send a valid Content-Length") from None
        if size > max_bytes:
            raise http_error(413, "body", f"{size} bytes exceed the limit of {max_bytes}", "send smaller requests")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > max_bytes:
            raise http_error(413, "body", f"more than {max_bytes} bytes", "send smaller requests")
        chunks.append(chunk)
    return b"".join(chunks)


def add_health(app: FastAPI, info: Callable[[], dict] = dict, problem: Callable[[], HealthProblem | None] = lambda: None) -> None:
    """``GET /healthz``, no secrets, no auth: 200 while the service can do its job, else 503 with
    the reason and whether a restart would help (components/fleet/health.py)."""

    @app.get(HEALTH_PATH)
    async def healthz() -> JSONResponse:
        found = await asyncio.to_thread(problem)
        if found is not None:
            return JSONResponse({"ok": False, "restart": found.restart, "reason": found.reason, **info()}, status_code=503)
        return JSONResponse({"ok": True, **info()})


def serve(app: FastAPI, cfg: FleetRuntimeConfig, port: int, access_log: bool = True) -> None:
    """Run ``app`` on ``cfg.host``:``port`` until SIGINT/SIGTERM (503 past ``cfg.max_connections`` at
    once), on ``cfg.event_loop`` with ``cfg.http_parser`` (auto: uvloop and httptools when importable).
    Logging is the caller's (tokens redacted), not uvicorn's."""
    config = uvicorn.Config(
        app, host=cfg.host, port=port, log_config=None, access_log=access_log, lifespan="on",
        limit_concurrency=cfg.max_connections, http=cfg.http_parser,
    )
    server = uvicorn.Server(config)
    with asyncio.Runner(loop_factory=event_loop_factory(cfg.event_loop)) as runner:
        runner.run(server.serve())


def event_loop_factory(kind: str = "auto"):
    """uvloop's loop for ``uvloop`` (and ``auto`` when it is installed): a C event loop, a little less
    of a service's core per request; None (asyncio's own) for ``asyncio``."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise RuntimeError("runtime.event_loop: uvloop is not installed; pip install uvloop, or set "
                               "runtime.event_loop: asyncio") from None
        return None
    return uvloop.new_event_loop
