"""DVC snapshots of the episode dataset: every ingest that changes data gets a content hash.

``snapshot_dataset`` runs ``dvc add`` on the dataset folder (initialising DVC in the root when a
scratch root has none) and returns the directory hash DVC recorded in ``<folder>.dvc``. That hash
is what lineage logs; ``dvc checkout`` of the ``.dvc`` file restores exactly that data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml


# The dataset's writer lock is not data.
DVCIGNORE = ".fleetloop.lock\n"


@dataclass(frozen=True)
class Snapshot:
    hash: str  # DVC md5 of the directory ("...dir")
    dvc_file: Path
    nfiles: int
    changed: bool


def _dvc_file(folder: Path) -> Path:
    return folder.with_name(folder.name + ".dvc")


def read_snapshot(folder: Path) -> Snapshot | None:
    """The last snapshot recorded for ``folder``, or None if it was never snapshotted."""
    dvc_file = _dvc_file(folder)
    if not dvc_file.exists():
        return None
    out = yaml.safe_load(dvc_file.read_text())["outs"][0]
    return Snapshot(hash=out["md5"], dvc_file=dvc_file, nfiles=int(out.get("nfiles", 0)), changed=False)


def snapshot_dataset(root: Path, folder: Path) -> Snapshot:
    """``dvc add`` the folder inside the DVC repo at ``root``; a no-op when nothing changed."""
    from dvc.repo import Repo

    root, folder = root.resolve(), folder.resolve()
    if not folder.is_relative_to(root):
        raise ValueError(f"dataset folder {folder} must live inside the root {root} to be snapshotted by DVC")
    if not (root / ".dvc").exists():
        Repo.init(str(root), no_scm=not (root / ".git").exists())
        ignore = root / ".dvcignore"
        if not ignore.exists():
            ignore.write_text(DVCIGNORE)
    before = read_snapshot(folder)
    with Repo(str(root)) as repo:
        repo.add(str(folder))
    after = read_snapshot(folder)
    if after is None:
        raise RuntimeError(f"dvc add {folder} wrote no {_dvc_file(folder).name}; check the DVC repo at {root}")
    changed = before is None or before.hash != after.hash
    return Snapshot(after.hash, after.dvc_file, after.nfiles, changed)
