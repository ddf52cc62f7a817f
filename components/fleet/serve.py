"""Process entry point: ``python -m components.fleet.serve ROLE --settings FILE [--name ROBOT]``.

One role per process (ingest, inference, trainer, robot, coordinator). Logging goes through the
token-redacting filter before anything else runs. Heavy imports happen only for the role run.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from components.fleet.auth import SERVICE, TokenBook, configure_logging, token_for
from components.fleet.clients import base_url
from components.fleet.identity import watch_parent
from components.fleet.layout import RuntimeLayout
from components.fleet.processes import ROLES, read_settings

log = logging.getLogger("components.fleet.serve")


def _exit_on_sigterm() -> None:
    """Non-HTTP roles: SIGTERM raises SystemExit so ``finally`` blocks run (HTTP roles: uvicorn)."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="components.fleet.serve")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--name", default="", help="robot id (role robot)")
    args = parser.parse_args(argv)

    settings = read_settings(args.settings)
    cfg = settings.runtime
    layout = RuntimeLayout.of(settings)
    book = TokenBook(layout.token_file, cfg.tokens)
    configure_logging(book.secrets)
    log.info("starting %s %s", args.role, args.name)
    if args.role != "coordinator":
        watch_parent(cfg.heartbeat_s, cfg.stop_grace_s)  # a member never outlives its coordinator

    if args.role == "ingest":
        from components.fleet.http_server import serve
        from components.fleet.ingest_service import create_ingest_app

        serve(create_ingest_app(settings, book), cfg, cfg.ingest_port)
    elif args.role == "inference":
        from components.fleet.http_server import serve
        from components.fleet.inference_service import create_inference_app

        serve(create_inference_app(settings, book), cfg, cfg.inference_port, access_log=False)  # one access line per control step: off
    elif args.role == "coordinator":
        from components.fleet.coordinator import CoordinatorAlreadyRunning, run_coordinator

        try:
            run_coordinator(settings, book)
        except CoordinatorAlreadyRunning as exc:
            log.error("%s", exc)
            return 1
    elif args.role == "trainer":
        from components.fleet.trainer import run_trainer

        _exit_on_sigterm()
        token = token_for(SERVICE, layout.token_file, cfg.tokens)
        run_trainer(settings, token, base_url(cfg.host, cfg.coordinator_port))
    elif args.role == "robot":
        from components.fleet.robot_agent import run_robot

        if not args.name:
            parser.error("role robot needs --name <robot id>")
        _exit_on_sigterm()
        token = token_for(args.name, layout.token_file, cfg.tokens)
        return run_robot(settings, args.name, token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
