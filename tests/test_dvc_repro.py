"""`dvc repro` in a fresh git+DVC repo: builds dataset → model → metrics; a second run does nothing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SMALL_PARAMS = {
    "demo": {"expert_robots": 2, "expert_episodes_per_robot": 4},
    "fleet": {"num_heldout_robots": 2},
    "train": {"epochs": 2, "batch_size": 64, "method": "fert", "steps_per_iteration": 10, "validation_robots": 1},
    "scheduler": {"plan": "sequential"},
    "evaluation": {"trials_per_robot": 2, "trials_per_task": 4},
    "device": "cpu",
}


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("FLEETLOOP_ROOT", None)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _make_repo(dst: Path) -> Path:
    for name in ("components", "flows", "cli"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore", ".gitignore"):
        shutil.copy(REPO / name, dst / name)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in SMALL_PARAMS.items():
        if isinstance(values, dict):
            params[section].update(values)
        else:
            params[section] = values
    (dst / "params.yaml").write_text(yaml.safe_dump(params))
    _run(["git", "init", "-q"], dst)
    _run([sys.executable, "-m", "dvc", "init", "-q"], dst)
    _run(["git", "add", "-A"], dst)
    _run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"], dst)
    return dst


def _flow_digest(repo: Path, root: Path) -> str:
    """Bootstrap as the retrain flow's tasks do (collect → ingest → train), with repo's params.yaml."""
    from components.config import load_settings
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.ingest import ingest_files
    from components.training.checkpoint import state_digest

    old = os.environ.get("FLEETLOOP_ROOT")
    os.environ["FLEETLOOP_ROOT"] = str(repo)
    try:
        settings = load_settings().model_copy(update={"root": root})
    finally:
        os.environ.pop("FLEETLOOP_ROOT") if old is None else os.environ.__setitem__("FLEETLOOP_ROOT", old)
    demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
    ingest_files(settings, demos.files)
    return state_digest(steps.train_policy(settings).result.policy.state_dict())


@pytest.mark.slow
def test_dvc_repro_parity_noop_metrics_plots_and_experiments(tmp_path):
    repo = _make_repo(tmp_path / "repo")
    first = _run([sys.executable, "-m", "dvc", "repro"], repo)
    assert "Running stage 'evaluate'" in first
    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    assert metrics["trials"] == 2 * 2 and 0.0 <= metrics["success_rate"] <= 1.0
    assert (repo / "dvc.lock").exists()

    # the flow's own steps, on the same params in another root, train the same weights bit for bit
    trained = json.loads((repo / "metrics" / "train.json").read_text())
    assert trained["method"] == "fert" and trained["plan"] == "sequential"
    assert trained["weights_digest"] == _flow_digest(repo, tmp_path / "flow-root")

    second = _run([sys.executable, "-m", "dvc", "repro"], repo)
    assert "Data and pipelines are up to date" in second
    assert "Running stage" not in second

    # a second clone rebuilds the same metrics, bit for bit (CPU determinism)
    other = _make_repo(tmp_path / "other")
    _run([sys.executable, "-m", "dvc", "repro"], other)
    for name in ("eval.json", "train.json", "loss.csv", "eval_by_robot.csv"):
        assert (other / "metrics" / name).read_bytes() == (repo / "metrics" / name).read_bytes(), name

    shown = json.loads(_run([sys.executable, "-m", "dvc", "metrics", "show", "--json"], repo))
    assert shown  # dvc reads our metrics files
    assert "success_rate" in json.dumps(shown)
    _run([sys.executable, "-m", "dvc", "plots", "show", "--out", "plots"], repo)
    assert (repo / "plots" / "index.html").exists()

    # an experiment with one changed param reruns train + evaluate only
    exp = _run([sys.executable, "-m", "dvc", "exp", "run", "-S", "train.lr=0.003"], repo)
    assert "Running stage 'train'" in exp and "Running stage 'collect'" not in exp
    listed = _run([sys.executable, "-m", "dvc", "exp", "show", "--no-pager", "--json"], repo)
    assert "0.003" in listed
