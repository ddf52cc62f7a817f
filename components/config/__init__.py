"""One typed settings object for all of fleetloop.

Built from ``params.yaml`` (found at the root, else beside this package) and overridden by
environment variables: ``FLEETLOOP_ROOT`` for the root, ``FLEETLOOP_<SECTION>__<KEY>`` for any
field (e.g. ``FLEETLOOP_TRAIN__EPOCHS=3``).

Each section is the config of one component room; components receive *their* section object and
never read the environment themselves. The sections live by area (``world.py``: the simulated fleet
and evaluation; ``data.py``: dataset and store; ``learning.py``: policy, training, FERT, shuffle,
scheduler; ``operations.py``: registry, ops, fleet runtime); this package imports nothing from the
rest of ``components`` so every room may depend on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from components.config.base import PARAMS_FILE, REPO_ROOT, Section
from components.config.data import STORE_URI_SCHEMES, EpisodesConfig, StoreConfig, VideoConfig
from components.config.learning import (
    DistributedConfig,
    ExplainConfig,
    FertConfig,
    PolicyConfig,
    SchedulerConfig,
    ShuffleConfig,
    TrainConfig,
)
from components.config.operations import FleetRuntimeConfig, OpsConfig, RegistryConfig
from components.config.world import CameraConfig, DemoConfig, EvaluationConfig, FleetConfig, PackConfig, SimConfig


class Paths(Section):
    """Every on-disk location, derived from one root so two roots never share state."""

    root: Path

    @property
    def datasets(self) -> Path:
        return self.root / "datasets"

    @property
    def episodes(self) -> Path:
        return self.datasets / "episodes"

    @property
    def incoming(self) -> Path:
        return self.datasets / "incoming"

    @property
    def quarantine(self) -> Path:
        return self.datasets / "quarantine"

    @property
    def store(self) -> Path:
        return self.datasets / "segments.lance"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def prefect_home(self) -> Path:
        return self.root / ".prefect"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"


class _YamlSource(PydanticBaseSettingsSource):
    """Reads params.yaml from the root (FLEETLOOP_ROOT or the repository)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = params_path()
        if not path.exists():
            return {}
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of sections at the top level")
        _refuse_passwords(data, path)
        return data


# (section, field) of the store URIs that may carry user:password@: refused in params.yaml, redacted when shown
SECRET_URI_FIELDS = (("registry", "tracking_uri"), ("registry", "artifact_uri"), ("store", "uri"))


def _refuse_passwords(data: dict[str, Any], path: Path) -> None:
    """params.yaml is committed: a store URI with a password in it is an error (secrets come from env)."""
    for section, key in SECRET_URI_FIELDS:
        values = data.get(section) or {}
        uri = values.get(key) if isinstance(values, dict) else None
        if isinstance(uri, str) and urlsplit(uri).password:
            raise ValueError(
                f"{path}: {section}.{key} holds a password; remove it from the file and set the URI in "
                f"FLEETLOOP_{section.upper()}__{key.upper()} (or the store's own secret: MLFLOW_TRACKING_PASSWORD, "
                "~/.pgpass, ~/.aws/credentials)"
            )


def params_path() -> Path:
    root = Path(os.environ.get("FLEETLOOP_ROOT", REPO_ROOT))
    candidate = root / PARAMS_FILE
    return candidate if candidate.exists() else REPO_ROOT / PARAMS_FILE


class Settings(BaseSettings):
    """The whole configuration. ``Settings()`` reads params.yaml + environment."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETLOOP_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    root: Path = Field(default=REPO_ROOT)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    sim: SimConfig = SimConfig()
    fleet: FleetConfig = FleetConfig()
    episodes: EpisodesConfig = EpisodesConfig()
    store: StoreConfig = StoreConfig()
    policy: PolicyConfig = PolicyConfig()
    train: TrainConfig = TrainConfig()
    shuffle: ShuffleConfig = ShuffleConfig()
    distributed: DistributedConfig = DistributedConfig()
    fert: FertConfig = FertConfig()
    explain: ExplainConfig = ExplainConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    registry: RegistryConfig = RegistryConfig()
    demo: DemoConfig = DemoConfig()
    ops: OpsConfig = OpsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    runtime: FleetRuntimeConfig = FleetRuntimeConfig()

    @model_validator(mode="after")
    def _ranks_split_over_nodes(self) -> Settings:
        self.distributed.nproc_per_node(self.train.world_size)  # raises, naming both fields
        return self

    @field_validator("root")
    @classmethod
    def _absolute_root(cls, value: Path) -> Path:
        return Path(value).expanduser().resolve()

    @property
    def paths(self) -> Paths:
        return Paths(root=self.root)

    def known_robots(self) -> set[str]:
        """Every robot id ingest accepts: the collecting fleet, held-out robots and extras."""
        max_fleet = max(self.fleet.num_robots, 96)
        return set(self.fleet.robot_ids(max_fleet)) | set(self.fleet.heldout_ids()) | set(
            self.fleet.extra_robots
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))


def load_settings(**overrides: Any) -> Settings:
    """Settings from params.yaml + env, with keyword overrides taking precedence."""
    return Settings(**overrides)


__all__ = [
    "CameraConfig",
    "DemoConfig",
    "DistributedConfig",
    "EpisodesConfig",
    "EvaluationConfig",
    "ExplainConfig",
    "FertConfig",
    "FleetConfig",
    "FleetRuntimeConfig",
    "OpsConfig",
    "PARAMS_FILE",
    "PackConfig",
    "Paths",
    "PolicyConfig",
    "REPO_ROOT",
    "RegistryConfig",
    "SECRET_URI_FIELDS",
    "STORE_URI_SCHEMES",
    "SchedulerConfig",
    "Section",
    "Settings",
    "ShuffleConfig",
    "SimConfig",
    "StoreConfig",
    "TrainConfig",
    "VideoConfig",
    "load_settings",
    "params_path",
]
