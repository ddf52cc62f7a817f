"""The one atomic-write helper every store uses: old file or new file, never half, never a leak."""

from __future__ import annotations

import os
import stat

import pytest

from components.fsio import atomic_path, atomic_write_bytes, atomic_write_text


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temp(tmp_path):
    target = tmp_path / "meta" / "info.json"
    atomic_write_text(target, '{"old": true}')
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text('{"new": tr')  # half written when the writer dies
        raise RuntimeError("writer crashed")
    assert target.read_text() == '{"old": true}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["info.json"]


def test_a_secret_is_created_with_its_mode_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        atomic_write_bytes(tmp_path / "tokens.json", b"secret", mode=0o600)
        atomic_write_bytes(tmp_path / "tokens.json", b"rotated", mode=0o600)
    finally:
        os.umask(old)
    path = tmp_path / "tokens.json"
    assert path.read_bytes() == b"rotated" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_named_temp_file_is_the_one_a_crash_sweeper_looks_for(tmp_path):
    seen = []
    with atomic_path(tmp_path / "data.parquet", tmp_name="data.parquet.tmp") as tmp:
        seen.append(tmp.name)
        tmp.write_bytes(b"x")
    assert seen == ["data.parquet.tmp"] and (tmp_path / "data.parquet").read_bytes() == b"x"
