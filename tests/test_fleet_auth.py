"""Security rules of the fleet runtime: per-robot tokens, revocation, scopes, limits, no tokens in logs."""

from __future__ import annotations

import io
import logging
import stat

import httpx
import pytest
from pydantic import SecretStr

from components.episodes.dataset import EpisodeDataset
from components.episodes.schema import episode_to_ipc
from components.fleet.auth import (
    REDACTED,
    ROBOT,
    SERVICE,
    AuthError,
    RedactTokens,
    TokenBook,
    issue_tokens,
    read_token_file,
    revoke_robot,
    token_digest,
)
from components.fleet.layout import RuntimeLayout
from components.fleet.local import running_service, service_url, synthetic_episode, with_free_ports
from tests.conftest import small_settings

ROBOTS = ["robot-0000", "robot-0001", "robot-0002"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth")
    settings = with_free_ports(small_settings(root), max_upload_bytes=64 * 1024)
    layout = RuntimeLayout.of(settings).ensure()
    issue_tokens(layout.token_file, ROBOTS)
    with running_service(settings, "ingest") as proc:
        yield settings, layout, proc


def _post(settings, token: str | None, body: bytes, headers: dict | None = None) -> httpx.Response:
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{service_url(settings, 'ingest')}/v1/episodes", content=body, headers=hdrs, timeout=10.0)


def _stored(settings) -> int:
    return EpisodeDataset(settings.paths.episodes, settings.episodes).num_episodes


def _quarantined(settings) -> int:
    folder = settings.paths.quarantine
    return len(list(folder.iterdir())) if folder.exists() else 0


def test_missing_malformed_and_unknown_tokens_get_401_and_store_nothing(fleet):
    settings, _, _ = fleet
    body = episode_to_ipc(synthetic_episode(ROBOTS[0], seed=10))
    before, quarantined = _stored(settings), _quarantined(settings)
    for response in (
        _post(settings, None, body),
        _post(settings, None, body, {"Authorization": "Basic dXNlcjpwdw=="}),
        _post(settings, "not-a-real-token", body),
    ):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["detail"]["field"] == "Authorization"
    assert _stored(settings) == before and _quarantined(settings) == quarantined


def test_robot_may_upload_only_its_own_episodes(fleet):
    settings, layout, _ = fleet
    tokens = read_token_file(layout.token_file)
    before, quarantined = _stored(settings), _quarantined(settings)
    other = episode_to_ipc(synthetic_episode(ROBOTS[1], seed=11))
    refused = _post(settings, tokens.robots[ROBOTS[0]], other)
    assert refused.status_code == 403 and "own episodes" in refused.json()["detail"]["reason"]
    assert _stored(settings) == before and _quarantined(settings) == quarantined
    own = _post(settings, tokens.robots[ROBOTS[1]], other)
    assert own.status_code == 201 and _stored(settings) == before + 1


def test_scopes_robot_tokens_cannot_read_admin_endpoints_service_cannot_upload(fleet):
    settings, layout, _ = fleet
    tokens = read_token_file(layout.token_file)
    url = service_url(settings, "ingest")
    robot = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {tokens.robots[ROBOTS[0]]}"})
    service = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {tokens.service}"})
    assert robot.status_code == 403 and service.status_code == 200
    assert service.json()["episodes"] == _stored(settings)
    upload = _post(settings, tokens.service, episode_to_ipc(synthetic_episode(ROBOTS[0], seed=12)))
    assert upload.status_code == 403


def test_revoked_token_gets_403_immediately_and_stores_nothing(fleet):
    settings, layout, _ = fleet
    old = read_token_file(layout.token_file).robots[ROBOTS[2]]
    body = episode_to_ipc(synthetic_episode(ROBOTS[2], seed=13))
    revoke_robot(layout.token_file, ROBOTS[2])
    before = _stored(settings)
    response = _post(settings, old, body)
    assert response.status_code == 403 and "revoked" in response.json()["detail"]["reason"]
    assert _stored(settings) == before
    assert ROBOTS[2] not in issue_tokens(layout.token_file, [ROBOTS[2]]).robots  # a revoke stays revoked
    fresh = issue_tokens(layout.token_file, [ROBOTS[2]], readmit=[ROBOTS[2]]).robots[ROBOTS[2]]
    assert fresh != old and _post(settings, fresh, body).status_code == 201


def test_oversized_requests_get_413_and_store_nothing(fleet):
    settings, layout, _ = fleet
    token = read_token_file(layout.token_file).robots[ROBOTS[0]]
    before = _stored(settings)
    response = _post(settings, token, b"x" * (settings.runtime.max_upload_bytes + 10))
    assert response.status_code == 413 and _stored(settings) == before


def test_no_token_ever_reaches_the_service_log(fleet):
    settings, layout, proc = fleet
    tokens = read_token_file(layout.token_file)
    # provoke logging: refused uploads (wrong robot, unknown token) and successful ones
    _post(settings, tokens.robots[ROBOTS[0]], episode_to_ipc(synthetic_episode(ROBOTS[1], seed=14)))
    _post(settings, "leaky-unknown-token-value-123", b"x")
    _post(settings, tokens.robots[ROBOTS[0]], b"garbage")
    log_text = (layout.logs / "ingest.log").read_text()
    assert "refused" in log_text  # the log has content about these requests...
    secrets = [*tokens.robots.values(), tokens.service, "leaky-unknown-token-value-123"]
    assert not [s for s in secrets if s in log_text]  # ...but no credential


def test_redaction_filter_covers_messages_args_and_tracebacks():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactTokens(lambda: ["s3cr3t-token-abc"]))
    logger = logging.getLogger("fleet-redaction-test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("header Authorization: Bearer %s", "anything-here")
        logger.warning("token=%s in a query", "s3cr3t-token-abc")
        try:
            raise ValueError("bad token s3cr3t-token-abc")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "s3cr3t-token-abc" not in text and "anything-here" not in text
    assert text.count(REDACTED) >= 3 and "ValueError" in text


def test_token_file_is_private_and_rotation_revokes_the_old_token(tmp_path):
    path = tmp_path / "secrets" / "tokens.json"
    first = issue_tokens(path, ROBOTS[:2])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    book = TokenBook(path)
    assert book.authenticate(f"Bearer {first.robots[ROBOTS[0]]}").name == ROBOTS[0]
    assert book.require(f"Bearer {first.service}", [SERVICE]).role == SERVICE
    rotated = issue_tokens(path, ROBOTS[:2], rotate=True)
    assert token_digest(first.robots[ROBOTS[0]]) in rotated.revoked
    with pytest.raises(AuthError) as refused:
        book.authenticate(f"Bearer {first.robots[ROBOTS[0]]}")
    assert refused.value.status == 403
    assert book.authenticate(f"Bearer {rotated.robots[ROBOTS[0]]}").role == ROBOT


def test_tokens_from_the_environment_secret(tmp_path):
    book = TokenBook(tmp_path / "absent.json", SecretStr('{"robot-0007": "env-token-7", "service": "env-svc"}'))
    assert book.authenticate("Bearer env-token-7").name == "robot-0007"
    assert book.authenticate("Bearer env-svc").role == SERVICE
    with pytest.raises(AuthError) as unknown:
        book.authenticate("Bearer env-token-8")
    assert unknown.value.status == 401
    assert "env-token-7" not in repr(SecretStr('{"robot-0007": "env-token-7"}'))
