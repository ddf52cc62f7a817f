"""The MLflow model registry for ``fleetloop-policy``: log, register, promote, roll back, load.

Alias ``champion`` is what the fleet runs; ``previous`` is the champion it replaced, so
``rollback`` is one call. Every version carries its evaluation and lineage as version tags.
Models are logged with ``serialization_format="pickle"`` (a pt2 export cannot be fine-tuned,
STACK-NOTES) plus a plain ``state_dict`` artifact.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from components.config import RegistryConfig
from components.policy.normalizer import NormalizedPolicy
from components.registry.gate import GateDecision, two_proportion_gate
from components.registry.lineage import Lineage
from components.registry.tracking import configure_mlflow, redact_uri, scrub

PIP_REQUIREMENTS = [f"torch=={torch.__version__.split('+')[0]}", "fleetloop"]
REPLACED_TAG = "fleetloop.replaced_version"
SERIES_POINTS = 500  # per-step curves (loss, MoE expert shares) are strided down to about this many points
MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class RegistryError(RuntimeError):
    pass


@dataclass(frozen=True)
class PolicyVersion:
    name: str
    version: int
    run_id: str
    successes: int
    trials: int
    tags: dict[str, str]

    @property
    def success_rate(self) -> float:
        return self.successes / self.trials if self.trials else float("nan")

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    @property
    def lineage(self) -> Lineage:
        return Lineage.from_tags(self.tags)


class PolicyRegistry:
    def __init__(self, mlruns: Path, cfg: RegistryConfig) -> None:
        import mlflow
        from mlflow import MlflowClient

        self.cfg = cfg
        self.experiment_id = configure_mlflow(mlruns, cfg)
        self._mlflow = mlflow
        self.client = MlflowClient()

    # -- logging ---------------------------------------------------------------------------
    def log_candidate(
        self,
        policy: NormalizedPolicy,
        evaluation: dict,
        lineage: Lineage,
        params: dict,
        metrics: dict[str, float],
        loss_curve: list[float],
        run_name: str,
        tags: dict[str, str] | None = None,
        artifacts: list[Path] | None = None,
        dicts: dict[str, dict] | None = None,
        series: dict[str, list[float]] | None = None,
    ) -> PolicyVersion:
        """One MLflow run: params, metrics, lineage (+ ``tags``), files (``artifacts``: e.g. the
        schedule's Gantt image), JSON ``dicts``, per-step metric ``series`` (like the loss curve:
        e.g. MoE expert shares), the model; registered as a new version."""
        import mlflow.pytorch
        from mlflow.models import infer_signature

        mlflow = self._mlflow
        example = np.zeros((1, policy.obs_dim), dtype=np.float32)
        with torch.no_grad():
            output = policy.cpu()(torch.as_tensor(example)).numpy()
        signature = infer_signature(example, output)
        # We log pickle on purpose (a pt2 export cannot be fine-tuned); silence MLflow's generic caution.
        logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
        with mlflow.start_run(experiment_id=self.experiment_id, run_name=run_name) as run:
            mlflow.log_params(_flatten(params))
            mlflow.set_tags({**lineage.tags(), **(tags or {})})
            for name, values in {"train_loss": loss_curve, **(series or {})}.items():
                self._log_series(run.info.run_id, name, values)
            mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
            mlflow.log_metrics(
                {"eval_success_rate": evaluation["success_rate"], "eval_ci_low": evaluation["ci_low"], "eval_ci_high": evaluation["ci_high"]}
            )
            mlflow.log_dict(evaluation, "evaluation.json")
            for name, body in (dicts or {}).items():
                mlflow.log_dict(body, name)
            for path in artifacts or []:
                mlflow.log_artifact(str(path))
            with tempfile.TemporaryDirectory() as tmp:
                state_path = Path(tmp) / "state_dict.pt"
                torch.save(policy.state_dict(), state_path)
                mlflow.log_artifact(str(state_path))
            info = mlflow.pytorch.log_model(
                policy,
                name="policy",
                serialization_format="pickle",
                signature=signature,
                pip_requirements=PIP_REQUIREMENTS,
            )
        tags = {
            **lineage.tags(),
            **(tags or {}),
            "fleetloop.successes": str(evaluation["successes"]),
            "fleetloop.trials": str(evaluation["trials"]),
            "fleetloop.success_rate": f"{evaluation['success_rate']:.6f}",
            "fleetloop.evaluation": json.dumps(evaluation)[:4900],
        }
        # tags travel with the registration: one store transaction, so no version is ever visible
        # without its lineage (one call per tag also cost ~25 ms each on the SQLite store)
        model_version = mlflow.register_model(info.model_uri, self.cfg.model_name, tags=tags)
        return self.get_version(int(model_version.version))

    # -- reading ---------------------------------------------------------------------------
    def get_version(self, version: int) -> PolicyVersion:
        mv = self.client.get_model_version(self.cfg.model_name, str(version))
        tags = dict(mv.tags)
        return PolicyVersion(
            name=self.cfg.model_name,
            version=int(mv.version),
            run_id=mv.run_id,
            successes=int(tags.get("fleetloop.successes", 0)),
            trials=int(tags.get("fleetloop.trials", 0)),
            tags=tags,
        )

    def resolve(self, version_or_alias: str | int) -> PolicyVersion:
        """A version by number or alias; ``RegistryError`` naming what exists when there is none."""
        text = str(version_or_alias)
        number = int(text) if text.isdigit() else self.aliases().get(text)
        if number is None:
            raise RegistryError(f"no model version or alias {text!r} in {self.cfg.model_name}")
        try:
            return self.get_version(number)
        except Exception as exc:  # noqa: BLE001 - MlflowException: RESOURCE_DOES_NOT_EXIST
            raise RegistryError(f"model version {number} of {self.cfg.model_name} does not exist") from exc

    def run_dict(self, run_id: str, path: str) -> dict | None:
        """A JSON artifact of a run (``log_candidate``'s ``dicts``), or None when the run has none."""
        folder = path.rpartition("/")[0] or None
        if path not in {a.path for a in self.client.list_artifacts(run_id, folder)}:
            return None
        return self._mlflow.artifacts.load_dict(f"runs:/{run_id}/{path}")

    def log_run_folder(self, run_id: str, folder: Path, artifact_path: str) -> None:
        """Every file under ``folder`` onto a finished run, under ``artifact_path``."""
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def aliases(self) -> dict[str, int]:
        try:
            model = self.client.get_registered_model(self.cfg.model_name)
        except Exception:  # noqa: BLE001 - MlflowException when the model does not exist yet
            return {}
        return {alias: int(version) for alias, version in model.aliases.items()}

    def by_alias(self, alias: str) -> PolicyVersion | None:
        version = self.aliases().get(alias)
        return None if version is None else self.get_version(version)

    def champion(self) -> PolicyVersion | None:
        return self.by_alias(self.cfg.champion_alias)

    def versions(self) -> list[PolicyVersion]:
        found = self.client.search_model_versions(f"name='{self.cfg.model_name}'")
        return sorted((self.get_version(int(mv.version)) for mv in found), key=lambda v: v.version)

    def _log_series(self, run_id: str, name: str, values: list[float]) -> None:
        """About ``SERIES_POINTS`` evenly strided points of a per-step curve, in batches (one call
        per point is slow on the SQLite store)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [Metric(name, float(v), now, step) for step, v in enumerate(values[:: max(1, len(values) // SERIES_POINTS)])]
        for start in range(0, len(points), MLFLOW_BATCH):
            self.client.log_batch(run_id, metrics=points[start : start + MLFLOW_BATCH])

    def load(self, alias_or_version: str | int) -> NormalizedPolicy:
        import mlflow.pytorch

        ref = f"@{alias_or_version}" if isinstance(alias_or_version, str) and not alias_or_version.isdigit() else f"/{alias_or_version}"
        return mlflow.pytorch.load_model(f"models:/{self.cfg.model_name}{ref}", map_location="cpu")

    def load_uri(self, uri: str) -> NormalizedPolicy:
        """Any MLflow model URI this tracking store resolves: ``models:/<name>/<version>``,
        ``models:/<name>@<alias>``, ``runs:/<run id>/model``."""
        import mlflow.pytorch

        try:
            return mlflow.pytorch.load_model(uri, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - MlflowException / OSError: one message with the fix
            raise RegistryError(
                f"cannot load model {uri!r} from the tracking store {redact_uri(self._mlflow.get_tracking_uri())}: "
                f"{scrub(str(exc).splitlines()[0], self._mlflow.get_tracking_uri())}"
            ) from exc

    # -- promotion ---------------------------------------------------------------------------
    def promote_if_better(
        self,
        candidate: PolicyVersion,
        champion_successes: int | None,
        champion_trials: int | None,
        move_alias: bool = True,
    ) -> GateDecision:
        """Gate the candidate against the champion's evaluation on the same trials; move aliases
        (unless ``move_alias`` is False: a canary rollout moves them after live outcomes)."""
        decision = two_proportion_gate(
            candidate.successes, candidate.trials, champion_successes, champion_trials, self.cfg.gate_alpha
        )
        self.client.set_model_version_tag(self.cfg.model_name, str(candidate.version), "fleetloop.gate", decision.reason)
        if decision.promote and move_alias:
            self.set_champion(candidate.version)
        return decision

    def set_champion(self, version: int) -> None:
        name = self.cfg.model_name
        old = self.champion()
        if old is not None and old.version != version:
            self.client.set_registered_model_alias(name, self.cfg.previous_alias, str(old.version))
            self.client.set_model_version_tag(name, str(version), REPLACED_TAG, str(old.version))
        self.client.set_registered_model_alias(name, self.cfg.champion_alias, str(version))

    def rollback(self) -> PolicyVersion:
        """Champion <- previous; previous <- whatever that one had replaced (if anything)."""
        name = self.cfg.model_name
        current, previous = self.champion(), self.by_alias(self.cfg.previous_alias)
        if previous is None or current is None:
            raise RegistryError(
                f"nothing to roll back to: registered model {name!r} has no '{self.cfg.previous_alias}' alias "
                "(a rollback needs at least two promotions)"
            )
        self.client.set_registered_model_alias(name, self.cfg.champion_alias, str(previous.version))
        self.client.set_model_version_tag(name, str(current.version), "fleetloop.rolled_back", "true")
        earlier = previous.tags.get(REPLACED_TAG)
        if earlier:
            self.client.set_registered_model_alias(name, self.cfg.previous_alias, earlier)
        else:
            self.client.delete_registered_model_alias(name, self.cfg.previous_alias)
        return previous


def _flatten(params: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)[:500]
    return flat
