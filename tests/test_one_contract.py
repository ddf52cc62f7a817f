"""One identity per episode, one contract for both doors (issue 46): one corpus of good and bad
episode files goes to `fleetloop ingest` (the CLI, as a user runs it) and to the fleet ingest
service (real HTTP), in the same order; every file gets the same verdict at both, and both store
the same episodes under the same canonical ids."""

from __future__ import annotations

import dataclasses
import io
import json
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli.main import main
from components.episodes.dataset import EpisodeDataset
from components.episodes.record import STAGE_COLUMN
from components.episodes.schema import EPISODE_ID, episode_to_table
from components.episodes.validation import canonical_episode_id
from components.fleet.auth import issue_tokens
from components.fleet.clients import IngestClient
from components.fleet.layout import RuntimeLayout
from components.fleet.local import running_service, service_url, synthetic_episode, with_free_ports
from tests.conftest import small_settings

ROBOT = "robot-0000"
LENGTH = 12
UUID1 = "3bf16a5a-f174-11f1-af0b-02fc00000001"  # a version-1 uuid, fixed (xdist workers collect the same ids)


def _parquet(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _spelled(table: pa.Table, spelling: str) -> pa.Table:
    column = pa.array([spelling] * table.num_rows, pa.string())
    return table.set_column(table.schema.get_field_index(EPISODE_ID), EPISODE_ID, column)


def _corpus() -> list[tuple[str, bytes]]:
    """(name, Parquet bytes), in the order both doors receive them."""
    plain = episode_to_table(synthetic_episode(ROBOT, seed=1, length=LENGTH))
    other = episode_to_table(synthetic_episode(ROBOT, seed=2, length=LENGTH))
    spelled = str(uuid.UUID(plain.column(EPISODE_ID)[0].as_py()))
    nan = synthetic_episode(ROBOT, seed=3, length=LENGTH)
    nan.actions[2, 0] = np.nan
    stages = pa.array(np.minimum(np.arange(LENGTH) // 4, 2).astype(np.int8))
    return [
        ("plain", _parquet(plain)),
        ("plain, uuid in upper case", _parquet(_spelled(plain, spelled.upper()))),
        ("plain, uuid without hyphens", _parquet(_spelled(plain, uuid.UUID(spelled).hex))),
        ("plain, uuid in braces", _parquet(_spelled(plain, "{" + spelled + "}"))),
        ("other, uuid in upper case first", _parquet(_spelled(other, other.column(EPISODE_ID)[0].as_py().upper()))),
        ("other, canonical after", _parquet(other)),
        ("stage column (the simulator's)", _parquet(episode_to_table(
            synthetic_episode(ROBOT, seed=4, length=LENGTH)).append_column(STAGE_COLUMN, stages))),
        ("next.reward column", _parquet(episode_to_table(synthetic_episode(ROBOT, seed=5, length=LENGTH)).append_column(
            "next.reward", pa.array(np.zeros(LENGTH, np.float32))))),
        ("unknown extra column", _parquet(episode_to_table(synthetic_episode(ROBOT, seed=6, length=LENGTH)).append_column(
            "extra", pa.array(np.ones(LENGTH, np.float32))))),
        ("stage column as text", _parquet(episode_to_table(synthetic_episode(ROBOT, seed=7, length=LENGTH)).append_column(
            STAGE_COLUMN, pa.array(["grasp"] * LENGTH)))),
        ("uuid1 id", _parquet(_spelled(episode_to_table(synthetic_episode(ROBOT, seed=8, length=LENGTH)), UUID1))),
        ("no uuid at all", _parquet(_spelled(episode_to_table(synthetic_episode(ROBOT, seed=9, length=LENGTH)), "episode-9"))),
        ("NaN action", _parquet(episode_to_table(nan))),
    ]


EXPECTED = [  # stated before the run: what a user of either door should see
    "added", "duplicate", "duplicate", "duplicate", "added", "duplicate", "added", "added",
    ("rejected", "extra"), ("rejected", STAGE_COLUMN), ("rejected", EPISODE_ID), ("rejected", EPISODE_ID),
    ("rejected", "action"),
]


def _cli_verdict(path, capsys) -> str | tuple[str, str]:
    assert main(["ingest", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    if report["quarantined"]:
        return "rejected", report["quarantined"][0].removeprefix(f"{path}: ").split(": ")[0]
    return "added" if report["added"] else "duplicate"


def _fleet_verdict(client: IngestClient, body: bytes) -> str | tuple[str, str]:
    result = client.upload(body)
    assert (result.status, result.http_status) in {("added", 201), ("duplicate", 200), ("rejected", 422)}, result
    return ("rejected", result.detail["field"]) if result.status == "rejected" else result.status


def _stored_ids(root, settings) -> list[str]:
    return sorted(ep.episode_id for ep in EpisodeDataset(root, settings.episodes).episodes())


def test_one_corpus_gets_one_verdict_at_both_doors(tmp_path, monkeypatch, capsys, prefect_harness):
    corpus = _corpus()
    cli_root = tmp_path / "cli"
    monkeypatch.setenv("FLEETLOOP_ROOT", str(cli_root))
    cli = []
    for number, (_, body) in enumerate(corpus):
        path = cli_root / "incoming" / f"episode-{number:02d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        cli.append(_cli_verdict(path, capsys))

    settings = with_free_ports(small_settings(tmp_path / "fleet"), upload_rate_per_s=1e6, upload_burst=10**6)
    tokens = issue_tokens(RuntimeLayout.of(settings).ensure().token_file, [ROBOT])
    with running_service(settings, "ingest"):
        client = IngestClient(service_url(settings, "ingest"), tokens.robots[ROBOT], 10.0)
        fleet = [_fleet_verdict(client, body) for _, body in corpus]
        client.close()

    names = [name for name, _ in corpus]
    assert dict(zip(names, cli)) == dict(zip(names, fleet))
    assert dict(zip(names, cli)) == dict(zip(names, EXPECTED))
    from components.config import load_settings

    cli_ids = _stored_ids(load_settings().paths.episodes, load_settings())
    assert cli_ids == _stored_ids(settings.paths.episodes, settings) and len(cli_ids) == 4
    assert all(canonical_episode_id(i) == i for i in cli_ids)  # stored under the one spelling


@pytest.mark.parametrize("spelling", [str.upper, lambda s: s.replace("-", ""), lambda s: "{" + s + "}",
                                      lambda s: "urn:uuid:" + s, lambda s: s.upper().replace("-", "")])
def test_every_spelling_of_a_uuid4_reads_as_its_canonical_form(spelling):
    canonical = str(uuid.UUID(bytes=bytes(range(16)), version=4))
    assert canonical_episode_id(spelling(canonical)) == canonical


@pytest.mark.parametrize("value", ["", "episode-9", UUID1, str(uuid.uuid5(uuid.NAMESPACE_URL, "x")), None, 7])
def test_what_is_no_uuid4_has_no_canonical_form(value):
    assert canonical_episode_id(value) is None


def test_an_upload_with_a_non_canonical_id_stores_the_canonical_one(tmp_path):
    """In-memory episodes (what the flows store) go through the same canonicalisation."""
    from components.config import EpisodesConfig

    episode = synthetic_episode(ROBOT, seed=11, length=LENGTH)
    upper = dataclasses.replace(episode, episode_id=episode.episode_id.upper())
    dataset = EpisodeDataset(tmp_path / "episodes", EpisodesConfig())
    report = dataset.add_episodes([upper])
    again = dataset.add_episodes([episode])
    assert report.added == (episode.episode_id,) and again.duplicates == (episode.episode_id,)
    assert [ep.episode_id for ep in dataset.episodes()] == [episode.episode_id]
