"""Where the fleet runtime keeps its state under the root: spools, checkpoints, logs, pids, tokens.

Everything sits in ``<root>/<runtime.runtime_dir>`` (default ``fleet-runtime/``), which writes its
own ``.gitignore`` (``*``) when created, so spooled episodes and token files are never committed
even where the repository's ignore list does not name the folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from components.config import FleetRuntimeConfig, Settings

SETTINGS_FILE = "settings.json"
STATUS_FILE = "status.json"
COORDINATOR_PID_FILE = "coordinator.pid"
COORDINATOR_LOCK_FILE = "coordinator.lock"
GITIGNORE_BODY = "# fleet runtime state: spools, checkpoints, logs, tokens. Never commit.\n*\n"


@dataclass(frozen=True)
class RuntimeLayout:
    """Paths of one root's fleet runtime."""

    root: Path
    cfg: FleetRuntimeConfig

    @classmethod
    def of(cls, settings: Settings) -> "RuntimeLayout":
        return cls(settings.root, settings.runtime)

    @property
    def base(self) -> Path:
        return self.root / self.cfg.runtime_dir

    @property
    def spool_root(self) -> Path:
        return self.base / "spool"

    def spool(self, robot_id: str) -> Path:
        return self.spool_root / robot_id

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def checkpoints(self) -> Path:
        return self.base / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.base / "logs"

    @property
    def token_file(self) -> Path:
        return self.root / self.cfg.token_file

    @property
    def settings_file(self) -> Path:
        return self.state / SETTINGS_FILE

    @property
    def status_file(self) -> Path:
        return self.state / STATUS_FILE

    @property
    def coordinator_pid_file(self) -> Path:
        return self.state / COORDINATOR_PID_FILE

    @property
    def coordinator_lock_file(self) -> Path:
        return self.state / COORDINATOR_LOCK_FILE

    def ensure(self) -> "RuntimeLayout":
        """Create the folders (the base one self-ignoring for git)."""
        for folder in (self.base, self.spool_root, self.state, self.checkpoints, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        ignore = self.base / ".gitignore"
        if not ignore.exists():
            ignore.write_text(GITIGNORE_BODY)
        secrets = self.token_file.parent
        secrets.mkdir(parents=True, exist_ok=True)
        os.chmod(secrets, 0o700)
        return self
