"""Atomic file writes: a reader (or a crash) sees the old file or the new one, whole, never half.

    with atomic_path(dst) as tmp:   write tmp however you like (pyarrow, torch.save, copyfile, ...)
                                    -> fsync(tmp) -> os.replace(tmp, dst) -> fsync(dst's folder)
    atomic_write_bytes / atomic_write_text   the same for bytes or text in memory

The temporary file sits beside ``dst`` (same filesystem, so the rename is atomic) and is named
``.<name>.<pid>.tmp`` unless the caller names it (a reader that sweeps stray temp files after a
crash knows its own pattern). On an error the temporary file is removed and ``dst`` is untouched.
Like components/config/, this module imports nothing from the rest of ``components``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path, tmp_name: str | None = None, mode: int | None = None,
                durable: bool = True) -> Iterator[Path]:
    """A temporary path to write; replaces ``path`` with it when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        if durable and tmp.is_file():
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644, tmp_name: str | None = None,
                       durable: bool = True) -> None:
    with atomic_path(path, tmp_name, None, durable) as tmp:
        # created with its final mode: a secret is never readable by others, not even as a temp file
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, mode)  # the umask may have narrowed it


def atomic_write_text(path: Path, text: str, mode: int = 0o644, tmp_name: str | None = None,
                      durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), mode, tmp_name, durable)
