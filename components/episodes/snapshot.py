"""DVC snapshots of the episode dataset: every ingest that changes data gets a content hash.

``snapshot_dataset`` runs ``dvc add`` on the dataset folder (initialising DVC in the root when a
scratch root has none) and returns the directory hash DVC recorded in ``<folder>.dvc``. That hash
is what lineage logs; ``dvc checkout`` of the ``.dvc`` file restores exactly that data.

With a DVC remote (``episodes.dvc_remote``: ``s3://bucket/prefix`` on S3 or any S3-compatible
server, or a shared path) ``push_snapshot`` sends what the remote lacks of a snapshot, and
``pull_snapshot`` brings one back into a root that has none of it (another host, a lost cache).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from components.fsio import atomic_path

# The dataset's writer lock is not data, nor are the data files a merge replaced (kept a while
# for readers opened before it, components/episodes/data_files.py). And DVC walks the whole root
# to index it before every `dvc add`: what it never tracks in a root is ignored, or each
# snapshot's cost grows with the LanceDB store's fragment and version files (its largest folder
# by file count), the incoming spool, quarantine and MLflow's runs.
DVCIGNORE_LINES = (".fleetloop.lock", ".superseded/", "/datasets/segments.lance/", "/datasets/incoming/",
                   "/datasets/quarantine/", "/mlruns/")
REMOTE_NAME = "fleetloop"  # the DVC remote fleetloop configures in a root (.dvc/config)
DIR_HASH = re.compile(r"[0-9a-f]{32}\.dir")  # DVC's md5 of a directory


class SnapshotPushError(RuntimeError):
    """The snapshot is stored locally but the remote did not take it; the message names the fix."""


@dataclass(frozen=True)
class DvcRemote:
    url: str  # s3://bucket/prefix, or a path
    endpoint: str = ""  # an S3-compatible server's URL ("" = AWS); keys come from the environment


@dataclass(frozen=True)
class Snapshot:
    hash: str  # DVC md5 of the directory ("...dir")
    dvc_file: Path
    nfiles: int
    changed: bool


def _dvc_file(folder: Path) -> Path:
    return folder.with_name(folder.name + ".dvc")


def read_snapshot(folder: Path) -> Snapshot | None:
    """The last snapshot recorded for ``folder``, or None if it was never snapshotted or its record
    is torn (``torn_record``)."""
    dvc_file = _dvc_file(folder)
    out = _recorded_out(dvc_file) if dvc_file.exists() else None
    if out is None:
        return None
    return Snapshot(hash=out["md5"], dvc_file=dvc_file, nfiles=int(out.get("nfiles", 0)), changed=False)


def _recorded_out(dvc_file: Path) -> dict | None:
    """The record's entry for the folder, if whole: DVC writes ``path`` last, so a record cut short
    anywhere lacks it (or has it cut), and a cut hash does not look like one."""
    try:
        out = yaml.safe_load(dvc_file.read_text())["outs"][0]
    except (yaml.YAMLError, UnicodeDecodeError, TypeError, KeyError, IndexError):
        return None
    whole = (isinstance(out, dict) and out.get("path") == dvc_file.name.removesuffix(".dvc")
             and DIR_HASH.fullmatch(str(out.get("md5", ""))) is not None)
    return out if whole else None


def torn_record(folder: Path) -> bool:
    """Whether ``<folder>.dvc`` exists but records no snapshot. DVC writes that file in place, so a
    process killed during ``dvc add`` leaves it empty or cut short (found by
    tests/test_ingest_kills.py): DVC then cannot load the repo and every later snapshot failed. It
    is derived from the data (which is intact), so the next snapshot writes it again."""
    dvc_file = _dvc_file(folder)
    return dvc_file.exists() and _recorded_out(dvc_file) is None


def snapshot_dataset(root: Path, folder: Path) -> Snapshot:
    """``dvc add`` the folder inside the DVC repo at ``root``; a no-op when nothing changed."""
    from dvc.repo import Repo

    root, folder = root.resolve(), folder.resolve()
    if not folder.is_relative_to(root):
        raise ValueError(f"dataset folder {folder} must live inside the root {root} to be snapshotted by DVC")
    ensure_dvc_repo(root)
    before = read_snapshot(folder)
    if before is None and _dvc_file(folder).exists():  # torn (``torn_record``): DVC cannot load the repo with it
        _dvc_file(folder).unlink()
    with Repo(str(root)) as repo:
        repo.add(str(folder))
    after = read_snapshot(folder)
    if after is None:
        raise RuntimeError(f"dvc add {folder} wrote no {_dvc_file(folder).name}; check the DVC repo at {root}")
    changed = before is None or before.hash != after.hash
    return Snapshot(after.hash, after.dvc_file, after.nfiles, changed)


def ensure_dvc_repo(root: Path) -> None:
    """A DVC repo at ``root`` (initialised in a scratch root or a new host's root) whose lock
    file a killed process did not leave unreadable."""
    from dvc.repo import Repo

    if not (root / ".dvc").exists():
        quiet = logging.getLogger("dvc")  # DVC logs "Initialized DVC repository." at INFO to stdout,
        level = quiet.level               # which would break a `--json` answer (fleetloop reproduce)
        quiet.setLevel(logging.WARNING)
        try:
            Repo.init(str(root), no_scm=not (root / ".git").exists())
        finally:
            quiet.setLevel(level)
    ensure_dvcignore(root)
    repair_dvc_rwlock(root)


def repair_dvc_rwlock(root: Path) -> bool:
    """Remove ``.dvc/tmp/rwlock`` when it is not JSON; True if it was removed.

    DVC rewrites that file in place while holding its guard ``rwlock.lock`` (an OS file lock,
    released when its holder dies). So a process killed during the rewrite leaves it truncated, and
    every later ``dvc add`` of the root fails with RWLockFileCorruptedError until someone deletes it
    (found by tests/test_ingest_kills.py). Under the same guard, a file that is not JSON can only
    be a dead writer's: DVC reads a missing file as "no locks held". Stale entries of dead
    processes in a well-formed file DVC clears itself."""
    import json

    from dvc.lock import make_lock

    tmp = root / ".dvc" / "tmp"
    path = tmp / "rwlock"
    if not path.exists():
        return False
    with make_lock(str(tmp / "rwlock.lock"), tmp_dir=str(tmp), wait=True):
        try:
            json.loads(path.read_text(encoding="utf-8"))
            return False
        except FileNotFoundError:
            return False
        except (json.JSONDecodeError, UnicodeDecodeError):
            path.unlink()
            return True


def ensure_dvcignore(root: Path) -> None:
    """``DVCIGNORE_LINES`` in the root's .dvcignore (appended where missing: a root made before a
    line was added gets it on its next snapshot; the user's own lines stay)."""
    path = root / ".dvcignore"
    text = path.read_text() if path.exists() else ""
    missing = [line for line in DVCIGNORE_LINES if line not in text.splitlines()]
    if missing:
        with atomic_path(path) as tmp:
            tmp.write_text(text + ("" if not text or text.endswith("\n") else "\n") + "\n".join(missing) + "\n")


def use_remote(root: Path, remote: DvcRemote) -> None:
    """Point the DVC repo at ``root`` to ``remote`` (as ``REMOTE_NAME``, its default)."""
    from dvc.repo import Repo

    body = {"url": remote.url, **({"endpointurl": remote.endpoint} if remote.endpoint else {})}
    with Repo(str(root)) as repo, repo.config.edit() as conf:
        conf["remote"][REMOTE_NAME] = body
        conf["core"]["remote"] = REMOTE_NAME


def push_snapshot(root: Path, snapshot: Snapshot, remote: DvcRemote) -> int:
    """Send the remote what it lacks of ``snapshot`` (0 files when it has it all)."""
    from dvc.repo import Repo

    repair_dvc_rwlock(root)
    use_remote(root, remote)
    try:
        with Repo(str(root)) as repo:
            return int(repo.push(targets=[str(snapshot.dvc_file)], remote=REMOTE_NAME))
    except Exception as exc:  # dvc, botocore and OSError alike: one message with the fix
        where = remote.url + (f" at {remote.endpoint}" if remote.endpoint else "")
        raise SnapshotPushError(
            f"DVC snapshot {snapshot.hash} is stored in {root} but could not be pushed to {where} "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); check the remote and its keys "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), then ingest again: every ingest pushes what the remote lacks"
        ) from exc


def pull_snapshot(root: Path, dvc_file: Path, remote: DvcRemote, force: bool = False) -> None:
    """Fetch ``dvc_file``'s snapshot from ``remote`` into ``root``'s cache and check it out;
    ``force`` replaces a checkout of an older snapshot (the caller knows it holds nothing else)."""
    from dvc.repo import Repo

    ensure_dvc_repo(root)
    use_remote(root, remote)
    with Repo(str(root)) as repo:
        repo.pull(targets=[str(dvc_file)], remote=REMOTE_NAME, force=force)


def write_snapshot_file(folder: Path, snapshot_hash: str) -> Path:
    """``<folder>.dvc`` naming the snapshot ``snapshot_hash`` (what ``dvc add`` wrote when it was taken)."""
    dvc_file = _dvc_file(folder)
    dvc_file.write_text(yaml.safe_dump({"outs": [{"md5": snapshot_hash, "hash": "md5", "path": folder.name}]}))
    return dvc_file


def checkout_from_cache(root: Path, dvc_file: Path, source_root: Path) -> None:
    """Check ``dvc_file``'s snapshot out in ``root`` from the DVC cache of the repo at ``source_root``."""
    from dvc.repo import Repo

    with Repo(str(source_root)) as repo:
        cache = repo.cache.local_cache_dir
    with Repo(str(root)) as repo, repo.config.edit() as conf:
        conf["cache"]["dir"] = cache
    with Repo(str(root)) as repo:
        repo.checkout(targets=[str(dvc_file)])
