"""What a member's health means: can it do its job right now (disk, threads), not just "is it up".

    /healthz 200 {"ok": true, ...}                              healthy
    /healthz 503 {"ok": false, "restart": false, "reason": ...} alive but degraded (disk full):
                                                                 a restart would not help
    /healthz 503 {"ok": false, "restart": true, "reason": ...}  broken (a worker thread died):
                                                                 the coordinator restarts it
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# errno values that mean "no room": the disk, a quota, or the process's file-size limit
# (RLIMIT_FSIZE: EFBIG) is full. Each is fixed by freeing room, not by retrying at once.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NO_SPACE_TEXTS = tuple(os.strerror(e) for e in sorted(NO_SPACE_ERRNOS))  # "No space left on device", ...


@dataclass(frozen=True)
class HealthProblem:
    reason: str
    restart: bool  # would restarting the process fix it?


def disk_problem(path: Path, min_free_bytes: int) -> HealthProblem | None:
    """Too little free space under ``path`` (its nearest existing ancestor) to store safely."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < min_free_bytes:
        return HealthProblem(
            f"{free} bytes free under {path}, below runtime.min_free_bytes = {min_free_bytes}", restart=False
        )
    return None


def is_no_space(exc: BaseException) -> bool:
    """``exc`` (or what caused it) says the disk is full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if isinstance(exc, OSError) and any(t in str(exc) for t in NO_SPACE_TEXTS):  # pyarrow's IO errors carry no errno
            return True
        exc = exc.__cause__ or exc.__context__
    return False
