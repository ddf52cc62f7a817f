"""httpx clients for the fleet services, as a robot (or the runtime) sees them.

Network trouble never raises out of ``upload`` (it says "retry"); ``act`` raises
``InferenceUnavailable`` so the robot can hold a safe action (``ObservationRefused``, one kind of
it, when the served model wants another observation: frames, none, or other cameras).
A robot with cameras sends its frames in camera_wire.py's binary body; ``upload`` labels a camera
episode (camera_wire's episode body) as such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from collections.abc import Mapping

import httpx
import numpy as np

from components.fleet.camera_wire import EPISODE_TYPE, OBS_TYPE, encode_obs, is_episode_body

EPISODES_PATH = "/v1/episodes"
STATS_PATH = "/v1/stats"
ACT_PATH = "/v1/act"
POLICY_PATH = "/v1/policy"
HEARTBEAT_PATH = "/v1/heartbeat"
STATUS_PATH = "/v1/status"
ARROW_STREAM = "application/vnd.apache.arrow.stream"


def base_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class InferenceUnavailable(RuntimeError):
    """The inference service did not answer in time (or at all): hold a safe action."""


class ObservationRefused(InferenceUnavailable):
    """409/422 on the cameras: the served model wants another observation (ask ``policy()``)."""

    def __init__(self, message: str, detail: dict) -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True)
class ActResult:
    action: np.ndarray  # (act_dim,) float32
    version: int  # registry version that produced it
    alias: str  # champion | canary
    chunk: np.ndarray | None = None  # (k, act_dim): a chunk policy's next k actions (action = chunk[0])

    @property
    def policy_version(self) -> str:
        return f"v{self.version}"


@dataclass(frozen=True)
class UploadResult:
    """``status``: added | duplicate (stored either way) | rejected (4xx: do not retry) | retry."""

    status: str
    http_status: int = 0
    detail: dict = field(default_factory=dict)
    retry_after_s: float = 0.0  # the service's Retry-After (429/503/507), 0 when absent

    @property
    def stored(self) -> bool:
        return self.status in ("added", "duplicate")


class InferenceClient:
    def __init__(self, url: str, token: str, timeout_s: float) -> None:
        self._http = httpx.Client(base_url=url, headers=_auth(token), timeout=timeout_s)

    def act(self, obs: np.ndarray, images: Mapping[str, np.ndarray] | None = None) -> ActResult:
        """``obs``: the state (or a window of states); ``images``: each camera's (H, W, 3) uint8 frame,
        for a model that sees cameras (sent as camera_wire.py's binary body)."""
        try:
            if images is None:
                response = self._http.post(ACT_PATH, json={"obs": np.asarray(obs, dtype=np.float32).tolist()})
            else:
                response = self._http.post(ACT_PATH, content=encode_obs(obs, images), headers={"Content-Type": OBS_TYPE})
        except httpx.HTTPError as exc:
            raise InferenceUnavailable(f"{type(exc).__name__}") from None
        if response.status_code != 200:
            _raise_refusal(response)
        body = response.json()
        chunk = None if body.get("chunk") is None else np.asarray(body["chunk"], dtype=np.float32)
        return ActResult(np.asarray(body["action"], dtype=np.float32), int(body["version"]), str(body["alias"]), chunk)

    def policy(self) -> dict:
        response = self._http.get(POLICY_PATH)
        response.raise_for_status()
        return response.json()

    def cameras(self) -> dict[str, tuple[int, int]]:
        """The cameras the model serving this robot sees: key -> (height, width); {} for a state
        policy. ``InferenceUnavailable`` when the service does not answer."""
        try:
            cameras = self.policy().get("cameras", {})
        except (httpx.HTTPError, ValueError) as exc:
            raise InferenceUnavailable(f"{type(exc).__name__}") from None
        return {str(key): (int(shape[0]), int(shape[1])) for key, shape in cameras.items()}

    def close(self) -> None:
        self._http.close()


def _raise_refusal(response: httpx.Response) -> None:
    """A non-200 answer to /v1/act as the exception the robot acts on."""
    message = f"HTTP {response.status_code}: {response.text[:300]}"
    if response.status_code in (409, 422):
        try:
            detail = response.json().get("detail", {})
        except (ValueError, AttributeError):
            detail = {}
        if isinstance(detail, dict) and str(detail.get("field", "")).startswith("cameras"):
            raise ObservationRefused(message, detail)
    raise InferenceUnavailable(message)


def _retry_after(response: httpx.Response) -> float:
    """``Retry-After`` in seconds (the delta form; an HTTP date or garbage reads as 0)."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


class IngestClient:
    def __init__(self, url: str, token: str, timeout_s: float) -> None:
        self._http = httpx.Client(base_url=url, headers=_auth(token), timeout=timeout_s)

    def upload(self, data: bytes) -> UploadResult:
        try:
            kind = EPISODE_TYPE if is_episode_body(data) else ARROW_STREAM
            response = self._http.post(EPISODES_PATH, content=data, headers={"Content-Type": kind})
        except httpx.HTTPError as exc:
            return UploadResult("retry", 0, {"reason": type(exc).__name__})
        try:
            body = response.json()
        except ValueError:
            body = {"reason": response.text[:200]}
        if response.status_code in (200, 201):
            return UploadResult(str(body.get("status", "added")), response.status_code, body)
        detail = body.get("detail", body) if isinstance(body, dict) else {"reason": str(body)}
        detail = detail if isinstance(detail, dict) else {"reason": str(detail)}
        # 401/403 may be fixed by the operator (token file); 408/429 and 5xx are transient. Every
        # other 4xx is this upload's own fault: retrying it can never succeed.
        retry = response.status_code in (401, 403, 408, 429) or response.status_code >= 500
        return UploadResult("retry" if retry else "rejected", response.status_code, detail, _retry_after(response))

    def stats(self) -> dict:
        response = self._http.get(STATS_PATH)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._http.close()


class CoordinatorClient:
    def __init__(self, url: str, token: str, timeout_s: float) -> None:
        self._http = httpx.Client(base_url=url, headers=_auth(token), timeout=timeout_s)

    def heartbeat(self, name: str, info: dict | None = None) -> bool:
        """Renew ``name``'s lease; False when the coordinator is unreachable (keep working)."""
        try:
            response = self._http.post(HEARTBEAT_PATH, json={"name": name, "info": info or {}})
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def status(self) -> dict:
        response = self._http.get(STATUS_PATH)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._http.close()


class HeartbeatThread:
    """Renews ``name``'s lease with the coordinator every ``interval_s`` (a daemon thread)."""

    def __init__(
        self, client: CoordinatorClient, name: str, interval_s: float, info: Callable[[], dict] = dict,
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        import threading

        self.client = client
        self.name = name
        self.interval_s = interval_s
        self.info = info
        self.healthy = healthy
        self.skipped = 0  # renewals withheld because the member was unhealthy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.healthy():  # a member that cannot do its job lets its lease lapse
                self.client.heartbeat(self.name, self.info())
            else:
                self.skipped += 1
            self._stop.wait(self.interval_s)
