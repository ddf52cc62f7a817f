"""The inference service: robots send observations, get actions; requests are batched dynamically.

    POST /v1/act {"obs": [...]} (robot token; or {"obs": [[...], ...]}: the robot's last frames, which
      a history policy takes as its window and any other policy as its newest frame)
      -> alias for this robot (champion, or canary for the rollout share) -> queue
      -> batcher: the first request opens a window of ``batch_window_ms``; everything queued by
         then (up to ``max_batch``) runs as one forward pass per alias, off the event loop
      <- {"action": [...], "version": 7, "alias": "champion"}   (version = registry version)
    POST /v1/act, Content-Type application/x-fleetloop-obs (camera_wire.py): the state and each
      camera's raw uint8 frame, for a vision champion (``policy.kind: vision``); validated against
      the served model's ``ObservationLayout`` and packed with it in the batcher, at forward time,
      so a request always meets the layout of the model that runs it. GET /v1/policy says which
      cameras (key -> [H, W]) the model serving this robot sees ({} for a state policy). A state
      request to a vision model, or frames to a state model: 409 with the fix; wrong camera keys,
      shapes or dtypes: 422 naming the camera.
         a chunk policy (``policy.kind: chunk_transformer``) also sends {"chunk": [[...], ...]}: its
         next ``chunk_size`` actions, "action" being the first; the robot executes the chunk and
         re-plans (``robot_agent.py``, ``policy/ensemble.py``)

An ``AliasWatcher`` thread polls the registry aliases; when one moves it loads that version (a
small cache keeps recent ones, so canary -> champion is a pointer move) and swaps it in between
batches. Requests in flight finish on the model they started with; no request sees a half-loaded
model. Served models are also cached on local disk: a restarted service serves the last known
versions at once and reconciles with the registry in the background (and keeps serving while
the registry is down). With no champion yet the service answers 503 and robots hold a safe action.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from torch import nn

from components.config import Settings
from components.fleet.auth import ROBOT, SERVICE, Principal, TokenBook
from components.fleet.camera_wire import OBS_TYPE, WireError, decode_obs
from components.registry.canary import assigned_alias
from components.fleet.clients import ACT_PATH, POLICY_PATH, STATS_PATH
from components.fleet.health import HealthProblem
from components.fleet.loop_health import Durations, GcPauses, LoopLag, cancel_and_wait
from components.fleet.http_server import (
    NO_API_DOCS,
    add_health,
    auth_dependency,
    http_error,
    read_body_limited,
)
from components.fleet.layout import RuntimeLayout
from components.fsio import atomic_write_bytes
from components.policy.history import fit_window

log = logging.getLogger(__name__)

MAX_ACT_BYTES = 64 * 1024
# A camera request's body limit: the state and frames of a few cameras (four 256x256 ones fit).
# A candidate for a runtime config knob (runtime.max_camera_act_bytes); a module constant for now.
MAX_CAMERA_ACT_BYTES = 4 * 1024 * 1024
MAX_WINDOW = 64  # frames a robot may send in one /v1/act (a history policy's window)
MODEL_CACHE = 4  # loaded versions kept in memory (and on disk)
MODEL_CACHE_DIR = "inference-cache"


@dataclass(frozen=True)
class ServedModel:
    alias: str
    version: int
    policy: nn.Module


class ModelSlots:
    """alias -> ServedModel, swapped atomically (a dict assignment under a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, ServedModel] = {}

    def get(self, alias: str) -> ServedModel | None:
        with self._lock:
            return self._slots.get(alias)

    def put(self, model: ServedModel) -> None:
        with self._lock:
            self._slots[model.alias] = model

    def drop(self, alias: str) -> None:
        with self._lock:
            self._slots.pop(alias, None)

    def versions(self) -> dict[str, int]:
        with self._lock:
            return {alias: m.version for alias, m in self._slots.items()}


class ModelCache:
    """Served models kept on local disk, so a restarted service serves at once (warm restart) and
    keeps serving the last known champion while the registry is unreachable.

    ``<dir>/v<N>.pt`` is the whole module (pickled like the registry's own pickle-format models,
    and written only by this service); ``served.json`` is the last alias -> version it served.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version}.pt"

    def put(self, version: int, policy: nn.Module) -> None:
        path = self._path(version)
        if path.exists():
            return
        buffer = io.BytesIO()
        torch.save(policy, buffer)
        atomic_write_bytes(path, buffer.getvalue())
        for old in sorted(self.folder.glob("v*.pt"), key=lambda p: p.stat().st_mtime)[:-MODEL_CACHE]:
            old.unlink(missing_ok=True)

    def get(self, version: int) -> nn.Module | None:
        path = self._path(version)
        if not path.exists():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=False).eval()
        except Exception:  # noqa: BLE001 - a bad cache entry is re-fetched from the registry
            log.exception("model cache entry %s unreadable; ignoring it", path.name)
            return None

    def remember(self, served: dict[str, int]) -> None:
        atomic_write_bytes(self.folder / "served.json", json.dumps(served).encode())

    def warm_start(self, slots: "ModelSlots") -> dict[str, int]:
        """Fill ``slots`` from the last served aliases; returns what was restored."""
        try:
            served = {str(a): int(v) for a, v in json.loads((self.folder / "served.json").read_text()).items()}
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return {}
        restored = {}
        for alias, version in served.items():
            policy = self.get(version)
            if policy is not None:
                slots.put(ServedModel(alias, version, policy))
                restored[alias] = version
        return restored


class AliasWatcher:
    """Keeps the slots in step with the registry aliases (polling; loads happen off the hot path)."""

    def __init__(
        self,
        aliases_fn: Callable[[], dict[str, int]],
        load_fn: Callable[[int], nn.Module],
        slots: ModelSlots,
        watched: tuple[str, ...],
        poll_s: float,
        cache: ModelCache | None = None,
    ) -> None:
        self.cache = cache
        self.aliases_fn = aliases_fn
        self.load_fn = load_fn
        self.slots = slots
        self.watched = watched
        self.poll_s = poll_s
        self.swaps = 0
        self.last_poll = 0.0
        self._cache: OrderedDict[int, nn.Module] = OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alias-watcher", daemon=True)

    def _model(self, version: int) -> nn.Module:
        if version in self._cache:
            self._cache.move_to_end(version)
            return self._cache[version]
        policy = self.cache.get(version) if self.cache is not None else None
        if policy is None:
            policy = self.load_fn(version).eval()
            if self.cache is not None:
                self.cache.put(version, policy)
        self._cache[version] = policy
        while len(self._cache) > MODEL_CACHE:
            self._cache.popitem(last=False)
        return policy

    def poll_once(self) -> dict[str, int]:
        """Swap in whatever moved; returns alias -> version now served."""
        aliases = self.aliases_fn()
        for alias in self.watched:
            version = aliases.get(alias)
            current = self.slots.get(alias)
            if version is None:
                if current is not None:
                    self.slots.drop(alias)
                    self.swaps += 1
                    log.info("alias %s removed: no longer serving v%d", alias, current.version)
                continue
            if current is None or current.version != version:
                self.slots.put(ServedModel(alias, version, self._model(version)))
                self.swaps += 1
                log.info("alias %s -> v%d (was %s)", alias, version, f"v{current.version}" if current else "none")
        self.last_poll = time.time()
        served = self.slots.versions()
        if self.cache is not None:
            self.cache.remember(served)
        return served

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - registry hiccups must not kill serving; retried next poll
                log.exception("alias poll failed; serving what is loaded")
            self._stop.wait(self.poll_s)


class ObservationMismatch(Exception):
    """A request whose observation does not fit the served model's layout (status, field, reason, fix)."""

    def __init__(self, status: int, field: str, reason: str, fix: str) -> None:
        super().__init__(status, field, reason, fix)
        self.status, self.field, self.reason, self.fix = status, field, reason, fix


def served_cameras(model: ServedModel | None) -> dict[str, list[int]]:
    """The cameras ``model`` sees, key -> [height, width] (empty for a state policy)."""
    layout = getattr(model.policy, "layout", None) if model is not None else None
    return {c.key: [c.height, c.width] for c in layout.cameras} if layout is not None else {}


def observation_mismatch(model: ServedModel, images: dict[str, np.ndarray] | None) -> ObservationMismatch | None:
    """Why a request (state alone: ``images`` None; or with frames) cannot go to ``model``, or None."""
    wanted = served_cameras(model)
    if wanted and images is None:
        return ObservationMismatch(
            409, "cameras", f"the served model v{model.version} sees cameras {sorted(wanted)}; this request sends the state alone",
            f"send the state and these cameras' frames as Content-Type {OBS_TYPE} (components/fleet/camera_wire.py); "
            "GET /v1/policy lists them")
    if not wanted and images is not None:
        return ObservationMismatch(
            409, "cameras", f"the served model v{model.version} is a state policy; it takes no camera frames",
            'send the state alone as JSON {"obs": [numbers]}')
    if images is None:
        return None
    if set(images) != set(wanted):
        return ObservationMismatch(
            422, "cameras", f"got cameras {sorted(images)}, the served model v{model.version} sees {sorted(wanted)}",
            "send exactly the cameras GET /v1/policy lists (sim.cameras)")
    for key, (height, width) in wanted.items():
        if images[key].shape != (height, width, 3):
            return ObservationMismatch(
                422, f"cameras[{key}].shape", f"frames are {list(images[key].shape)}, the model was trained on "
                f"{[height, width, 3]}", f"render this camera at sim.camera.height = {height}, width = {width}")
    return None


@dataclass
class _Request:
    alias: str
    obs: np.ndarray
    future: asyncio.Future
    images: dict[str, np.ndarray] | None = None  # camera key -> (H, W, 3) uint8: a vision model's frames


class DynamicBatcher:
    """Collects requests for up to ``window_s`` (or ``max_batch``) and runs them as one forward pass."""

    def __init__(self, slots: ModelSlots, champion_alias: str, window_s: float, max_batch: int) -> None:
        self.slots = slots
        self.champion_alias = champion_alias
        self.window_s = window_s
        self.max_batch = max_batch
        self.batch_sizes: Counter[int] = Counter()
        self.forward = Durations()  # each batch's forward pass (and packing), on the event loop
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def alive(self) -> bool:
        """The batching task runs (before start: not yet judged)."""
        return self._task is None or not self._task.done()

    async def submit(self, alias: str, obs: np.ndarray, images: dict[str, np.ndarray] | None = None
                     ) -> tuple[np.ndarray, ServedModel]:
        assert self._queue is not None, "batcher not started"
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(alias, obs, future, images))
        return await future

    async def _gather(self) -> list[_Request]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        deadline = loop.time() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                while len(batch) < self.max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._gather()
            self.batch_sizes[len(batch)] += 1
            try:
                # Inline on the event loop: for fleet-sized policies one forward (~0.2-2 ms) costs
                # less than the two thread hand-offs an executor needs, which on a busy machine
                # were measured at ~20 ms each (benchmarks/fleet_load.py). A vision batch too: in a
                # thread it measured no better on 2 shared cores (benchmarks/vision_inference.py).
                began = time.perf_counter()
                results = self._forward(batch)
                self.forward.add(time.perf_counter() - began)
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error (503)
                log.exception("forward pass failed for a batch of %d", len(batch))
                results = [exc] * len(batch)
            for request, result in zip(batch, results):
                if request.future.done():
                    continue
                if isinstance(result, BaseException):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    def _forward(self, batch: list[_Request]) -> list:
        results: list = [None] * len(batch)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(batch):
            groups.setdefault(request.alias, []).append(i)
        for alias, rows in groups.items():
            model = self.slots.get(alias) or self.slots.get(self.champion_alias)
            if model is None:
                for i in rows:
                    results[i] = LookupError("no champion model is loaded yet")
                continue
            fitting = []
            for i in rows:  # the model may have changed since the handler checked the request
                mismatch = observation_mismatch(model, batch[i].images)
                if mismatch is not None:
                    results[i] = mismatch
                else:
                    fitting.append(i)
            if not fitting:
                continue
            with torch.no_grad():
                actions = model.policy(packed_batch(model, [batch[i] for i in fitting])).float().numpy()
            for row, i in enumerate(fitting):
                results[i] = (actions[row], model)
        return results


def packed_batch(model: ServedModel, requests: list[_Request]) -> torch.Tensor:
    """The requests' observations as ``model`` takes them: each robot's frames fitted to its history
    window; for a vision model, the states and frames packed with its layout (policy/observation.py)."""
    history = int(getattr(model.policy, "history", 1))
    obs = np.stack([fit_window(r.obs, history) for r in requests])
    layout = getattr(model.policy, "layout", None)
    if layout is not None and layout.cameras:
        obs = layout.pack(obs, {key: np.stack([r.images[key] for r in requests]) for key in layout.keys})
    return torch.as_tensor(obs)


class _LazyRegistry:
    """The root's PolicyRegistry, created on first use (importing MLflow takes seconds)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._registry = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._registry is None:
                from components.registry.model_registry import PolicyRegistry

                self._registry = PolicyRegistry(self.settings.paths.mlruns, self.settings.registry)
            return self._registry

    def aliases(self) -> dict[str, int]:
        return self._get().aliases()

    def load(self, version: int) -> nn.Module:
        return self._get().load(version)


def parse_obs(body: bytes, obs_dim: int, max_abs: float) -> np.ndarray:
    """``{"obs": [n floats]}`` -> float32 (n,), or ``{"obs": [[n floats], ...]}`` (a robot's last frames,
    oldest first, at most ``MAX_WINDOW``) -> (h, n); else a 422 naming the offending element.

    Only JSON numbers, finite, with ``|x| <= max_abs`` (runtime.max_abs_observation): a value the
    model cannot be asked about is the caller's error, never a 500 blamed on the model.
    """
    fix = f"send {obs_dim} finite observation numbers (or a list of such frames) with |x| <= {max_abs:g}"
    try:
        payload = json.loads(body)
        values = payload["obs"]
    except (ValueError, KeyError, TypeError):
        raise http_error(422, "obs", "body must be JSON {\"obs\": [numbers]}", fix) from None
    if isinstance(values, list) and values and all(isinstance(v, list) for v in values):
        if len(values) > MAX_WINDOW:
            raise http_error(422, "obs", f"a window of {len(values)} frames; at most {MAX_WINDOW}", fix)
        return np.stack([_frame(v, f"obs[{t}]", obs_dim, max_abs, fix) for t, v in enumerate(values)])
    return _frame(values, "obs", obs_dim, max_abs, fix)


def parse_camera_obs(body: bytes, obs_dim: int, max_abs: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A camera body (camera_wire.py) -> the state (n,) float32, validated as ``parse_obs`` validates
    one frame, and each camera's frame; a malformed body is a 422 naming the field."""
    try:
        values, images = decode_obs(body)
    except WireError as exc:
        raise http_error(422, exc.field, exc.reason, exc.fix) from None
    fix = f"send the state as {obs_dim} finite numbers with |x| <= {max_abs:g} in the header's \"obs\""
    return _frame(values, "obs", obs_dim, max_abs, fix), images


def _frame(values: object, field: str, obs_dim: int, max_abs: float, fix: str) -> np.ndarray:
    if not isinstance(values, list) or len(values) != obs_dim:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise http_error(422, field, f"expected a list of {obs_dim} numbers, got {got}", fix)
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise http_error(422, f"{field}[{i}]", f"not a number: {str(value)[:32]!r}", fix)
        if not math.isfinite(value):
            raise http_error(422, f"{field}[{i}]", f"NaN or inf value ({value}) in the observation", fix)
        if abs(value) > max_abs:
            raise http_error(422, f"{field}[{i}]", f"{value:g} is beyond runtime.max_abs_observation = {max_abs:g}", fix)
    return np.asarray(values, dtype=np.float32)


class InferenceService:
    """The service's moving parts (served slots, alias watcher, batcher, loop monitors) and what each
    route does with them; ``create_inference_app`` only wires the routes."""

    def __init__(self, settings: Settings, aliases_fn: Callable[[], dict[str, int]] | None = None,
                 load_fn: Callable[[int], nn.Module] | None = None) -> None:
        from components.sim.factory import observation_dim

        self.cfg, self.reg = settings.runtime, settings.registry
        if aliases_fn is None or load_fn is None:
            lazy = _LazyRegistry(settings)  # MLflow is imported on first use, off the startup path
            aliases_fn, load_fn = lazy.aliases, lazy.load
        self.obs_dim = observation_dim(settings.sim)
        self.slots = ModelSlots()
        self.cache = ModelCache(RuntimeLayout.of(settings).state / MODEL_CACHE_DIR)
        self.watcher = AliasWatcher(aliases_fn, load_fn, self.slots, (self.reg.champion_alias, self.cfg.canary_alias),
                                    self.cfg.alias_poll_s, self.cache)
        self.batcher = DynamicBatcher(self.slots, self.reg.champion_alias, self.cfg.batch_window_ms / 1000.0,
                                      self.cfg.max_batch)
        self.lag, self.pauses = LoopLag(), GcPauses()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        restored = self.cache.warm_start(self.slots)
        if restored:
            log.info("warm start from the local model cache: %s (the watcher reconciles with the registry)", restored)
        else:
            try:
                await asyncio.to_thread(self.watcher.poll_once)  # serve the champion from the first request
            except Exception:  # noqa: BLE001 - the watcher thread retries
                log.exception("initial alias poll failed")
        if self.cfg.gc_freeze:  # what start-up built lives as long as the service: no full collection walks it
            gc.freeze()
        self.watcher.start()
        self.batcher.start()
        self.lag.start()
        self.pauses.start()
        yield
        self.pauses.close()
        await self.lag.stop()
        await self.batcher.stop()
        await asyncio.to_thread(self.watcher.stop)

    def problem(self) -> HealthProblem | None:
        if not self.batcher.alive():
            return HealthProblem("the batching task has stopped", restart=True)
        return None

    def alias_for(self, principal: Principal) -> str:
        canary_live = self.slots.get(self.cfg.canary_alias) is not None
        return assigned_alias(principal.name, self.cfg.canary_share, canary_live, self.reg, self.cfg.canary_alias)

    def served_for(self, alias: str) -> ServedModel | None:
        return self.slots.get(alias) or self.slots.get(self.reg.champion_alias)

    async def observation(self, request: Request, model: ServedModel | None) -> tuple[np.ndarray, dict | None]:
        """The request's state (and frames, for a camera body), checked against ``model``'s layout."""
        if request.headers.get("content-type", "").split(";")[0].strip() == OBS_TYPE:
            body = await read_body_limited(request, MAX_CAMERA_ACT_BYTES)
            obs, images = parse_camera_obs(body, self.obs_dim, self.cfg.max_abs_observation)
        else:
            obs = parse_obs(await read_body_limited(request, MAX_ACT_BYTES), self.obs_dim, self.cfg.max_abs_observation)
            images = None
        mismatch = observation_mismatch(model, images) if model is not None else None
        if mismatch is not None:
            raise http_error(mismatch.status, mismatch.field, mismatch.reason, mismatch.fix)
        return obs, images

    async def act(self, request: Request, principal: Principal) -> dict:
        alias = self.alias_for(principal)
        obs, images = await self.observation(request, self.served_for(alias))
        try:
            action, model = await self.batcher.submit(alias, obs, images)
        except LookupError as exc:
            raise http_error(503, "model", str(exc), "promote a champion (fleetloop retrain --bootstrap)") from None
        except ObservationMismatch as exc:  # the model moved between the check and the forward pass
            raise http_error(409, exc.field, f"{exc.reason} (the served model changed)", f"{exc.fix}; then resend") from None
        if not np.isfinite(action).all():
            raise http_error(500, "action", "model produced a non-finite action", "roll back the champion")
        body = {"action": (action[0] if action.ndim == 2 else action).tolist(), "version": model.version,
                "alias": model.alias}
        if action.ndim == 2:  # a chunk policy's (chunk, m): the robot executes it and re-plans
            body["chunk"] = action.tolist()
        return body

    def policy(self, principal: Principal) -> dict:
        served = self.slots.versions()
        alias = self.alias_for(principal)
        return {
            "alias": alias,
            "cameras": served_cameras(self.served_for(alias)),  # key -> [H, W] this robot's frames must have
            "champion": served.get(self.reg.champion_alias),
            "canary": served.get(self.cfg.canary_alias),
            "canary_share": self.cfg.canary_share,
        }

    def stats(self) -> dict:
        sizes = self.batcher.batch_sizes
        batches = sum(sizes.values())
        requests = sum(size * count for size, count in sizes.items())
        return {
            "served": self.slots.versions(),
            "swaps": self.watcher.swaps,
            "last_alias_poll": self.watcher.last_poll,
            "batches": batches,
            "requests": requests,
            "mean_batch": requests / batches if batches else None,
            "max_batch_seen": max(sizes) if sizes else 0,
            "batch_sizes": {str(k): v for k, v in sorted(sizes.items())},
            # where a tail goes: how late the loop woke a 10 ms timer, GC pauses, forward passes
            "loop_lag": self.lag.summary(),
            "gc_pauses": self.pauses.summary(),
            "gc_frozen_objects": gc.get_freeze_count(),  # runtime.gc_freeze: start-up's objects, never walked
            "forward": self.batcher.forward.summary(),
        }


def create_inference_app(
    settings: Settings,
    book: TokenBook,
    aliases_fn: Callable[[], dict[str, int]] | None = None,
    load_fn: Callable[[int], nn.Module] | None = None,
) -> FastAPI:
    """The inference service; registry access defaults to the root's MLflow registry."""
    if settings.runtime.torch_threads:
        torch.set_num_threads(settings.runtime.torch_threads)
    service = InferenceService(settings, aliases_fn, load_fn)
    app = FastAPI(title="fleetloop inference", lifespan=service.lifespan, **NO_API_DOCS)
    fleet_member = auth_dependency(book, [ROBOT, SERVICE])
    service_only = auth_dependency(book, [SERVICE])
    add_health(app, lambda: {"service": "inference", "served": service.slots.versions()}, service.problem)

    @app.post(ACT_PATH)
    async def act(request: Request, principal: Principal = Depends(fleet_member)) -> JSONResponse:
        return JSONResponse(await service.act(request, principal))

    @app.get(POLICY_PATH)
    async def policy(principal: Principal = Depends(fleet_member)) -> JSONResponse:
        return JSONResponse(service.policy(principal))

    @app.get(STATS_PATH)
    async def stats(principal: Principal = Depends(service_only)) -> JSONResponse:
        return JSONResponse(service.stats())

    return app
