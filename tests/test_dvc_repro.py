"""The documented commands, verbatim, in a fresh git+DVC clone: `dvc repro` builds dataset → model →
metrics with the project's interpreter (none on PATH), a second run does nothing, and the model's
digest, losses and evaluation equal the flow's on the same params in another root. Every command README.md and docs/operations.md print
is run here or named in ELSEWHERE with the test (or reason) that covers it; so is every command of
docs/deploy.md."""

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


DOCS = (REPO / "README.md", REPO / "docs" / "operations.md", REPO / "docs" / "deploy.md")
# documented commands this file does not run, and what covers them
ELSEWHERE = {
    "make demo": "the demo itself (the README's first command; CI runs `make test`, whose set-up is the same)",
    "make test": "CI (.ci/run)",
    "make lock": "re-resolves requirements.lock (network); CI installs from the lock it writes (make setup)",
    "make compat": "a Python 3.12 venv with PyPI's CUDA torch (several GB): run by hand, result in docs/operations.md "
    "section 10; tests/compat/lerobot_round_trip.py is what it runs",
    "make ui": "long-running servers: tests/test_ops.py starts the same Prefect server and MLflow UI",
    "make deploy": "needs a running Prefect server: tests/test_ops.py deploys to one",
    ".venv/bin/prefect worker start --pool fleetloop-process": "a long-running worker: tests/test_ops.py runs a flow on a process pool",
    ".venv/bin/python -m tests.servers": "long-running servers: tests/test_registry_remote.py starts the same ones "
    "(tests/servers.py's fixtures)",
    ".venv/bin/fleetloop status": "tests/test_registry_remote.py runs `fleetloop status` against the tracking server "
    "it starts (tests/test_cli.py on a local root)",
    ".venv/bin/fleetloop lineage champion": "test_lineage_and_rollback_commands_verbatim below",
    ".venv/bin/fleetloop rollback": "test_lineage_and_rollback_commands_verbatim below",
    ".venv/bin/fleetloop reproduce champion": "test_lineage_and_rollback_commands_verbatim below (tests/test_reproduce.py: "
    "a fine-tuned FERT version after the data moved on, a mismatch, a refusal)",
    ".venv/bin/fleetloop explain champion --out explain-champion": "tests/test_explain.py (a fert version through the "
    "retrain flow, then `fleetloop explain VERSION --out DIR`; a bc version's one-line error)",
    "FLEETLOOP_SIM__CAMERAS='[\"scene\",\"gripper\"]' FLEETLOOP_POLICY__KIND=vision FLEETLOOP_FERT__ENCODER=camera .venv/bin/fleetloop demo":
    "tests/test_camera_loop.py runs it verbatim in a scratch root (smaller sizes beside it), then reproduces a version",
    ".venv/bin/fleetloop stage train": "tests/test_multinode.py runs it verbatim as node 0 of two hosts on loopback",
    ".venv/bin/fleetloop train-node --node-rank 1": "tests/test_multinode.py runs it verbatim as node 1 beside node 0",
}


def documented_commands() -> list[str]:
    """Every command in a ```bash block of the DOCS, comments stripped."""
    out = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.splitlines():
                cmd = line.split("#", 1)[0].strip()
                if cmd and cmd not in out:
                    out.append(cmd)
    return out


def _bare_env() -> dict[str, str]:
    """No venv on PATH and none active: the commands must find the project's interpreter themselves."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "FLEETLOOP_ROOT", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    return env


def _verbatim(cmd: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env or _bare_env(), capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


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
    (dst / ".venv").symlink_to(Path(sys.executable).parent.parent)  # where `make` puts it; ignored by git
    return dst


def _repo_settings(repo: Path, root: Path):
    """repo's params.yaml (as `fleetloop stage` reads it there), in another root."""
    from components.config import load_settings

    old = os.environ.get("FLEETLOOP_ROOT")
    os.environ["FLEETLOOP_ROOT"] = str(repo)
    try:
        return load_settings().model_copy(update={"root": root})
    finally:
        os.environ.pop("FLEETLOOP_ROOT") if old is None else os.environ.__setitem__("FLEETLOOP_ROOT", old)


def _flow_rebuild(settings) -> dict:
    """Bootstrap as the retrain flow's tasks do (collect → ingest → train → evaluate) with
    ``settings`` (_repo_settings): the figures `dvc repro` writes to metrics/."""
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.training.checkpoint import state_digest

    demos = collect_expert_demos(settings, settings.paths.incoming / "expert")
    ingest_files(settings, demos.files)
    result = steps.train_policy(settings).result
    report = evaluate_policy(settings, result.policy, "dvc-repro")
    return {"weights_digest": state_digest(result.policy.state_dict()), "final_loss": result.final_loss,
            "steps": result.steps, "success_rate": report.overall.rate, "trials": report.overall.trials,
            "failures_by_stage": report.failures_by_stage}


def test_every_documented_command_is_run_here_or_covered_elsewhere():
    commands = documented_commands()
    dvc = [c for c in commands if c.startswith(".venv/bin/dvc")]
    assert set(commands) == set(dvc) | set(ELSEWHERE), "a documented command is neither run here nor covered elsewhere"


@pytest.mark.slow
def test_documented_dvc_commands_verbatim_parity_noop_and_experiments(tmp_path):
    commands = documented_commands()
    dvc = [c for c in commands if c.startswith(".venv/bin/dvc")]
    assert dvc[:2] == [".venv/bin/dvc repro", ".venv/bin/dvc metrics show"]
    repo = _make_repo(tmp_path / "repo")
    # the flow's own steps on the same params in another root, in a thread while `dvc repro` runs
    # (its stage processes leave a core idle much of the time): compared below
    with ThreadPoolExecutor(1) as pool:
        rebuilt = pool.submit(_flow_rebuild, _repo_settings(repo, tmp_path / "flow-root"))
        first = _verbatim(".venv/bin/dvc repro", repo)
        flow = rebuilt.result()
    assert "Running stage 'evaluate'" in first
    metrics = json.loads((repo / "metrics" / "eval.json").read_text())
    assert metrics["trials"] == 2 * 2 and 0.0 <= metrics["success_rate"] <= 1.0
    assert (repo / "dvc.lock").exists()

    # the flow's own steps, on the same params in another root, train the same weights bit for bit
    # and evaluate them to the same figures (CPU determinism across roots and across the two paths)
    trained = json.loads((repo / "metrics" / "train.json").read_text())
    assert trained["method"] == "fert" and trained["plan"] == "sequential"
    assert {k: trained[k] for k in ("weights_digest", "final_loss", "steps")} == {k: flow[k] for k in ("weights_digest", "final_loss", "steps")}
    assert {k: metrics[k] for k in ("success_rate", "trials", "failures_by_stage")} == {
        k: flow[k] for k in ("success_rate", "trials", "failures_by_stage")}

    second = _verbatim(".venv/bin/dvc repro", repo)
    assert "Data and pipelines are up to date" in second and "Running stage" not in second
    outputs = {cmd: _verbatim(cmd, repo) for cmd in dvc[1:]}  # the rest, in the order the docs give them
    assert "success_rate" in outputs[".venv/bin/dvc metrics show"]
    assert (repo / "dvc_plots" / "index.html").exists()
    exp = outputs[".venv/bin/dvc exp run -S train.lr=0.003"]
    assert "Running stage 'train'" in exp and "Running stage 'collect'" not in exp
    listed = _run([sys.executable, "-m", "dvc", "exp", "show", "--no-pager", "--json"], repo)
    assert "0.003" in listed


@pytest.mark.slow
def test_lineage_and_rollback_commands_verbatim(tmp_path, prefect_harness):
    """After two promotions (what the demo leaves), the documented lineage, rollback and reproduce commands work."""
    from components.pipeline import steps
    from components.pipeline.collect import collect_expert_demos
    from components.pipeline.evaluate import evaluate_policy
    from components.pipeline.ingest import ingest_files
    from components.pipeline.promote import register_candidate
    from components.pipeline.workspace import Workspace
    from tests.conftest import small_settings

    root = tmp_path / "root"
    settings = small_settings(root)
    ingest_files(settings, collect_expert_demos(settings, root / "demos").files)  # a DVC snapshot: reproducible
    outcome = steps.train_policy(settings)
    registry = Workspace(settings).registry
    report = evaluate_policy(settings, outcome.result.policy, "first")
    for run_name in ("first", "second"):
        version = register_candidate(settings, outcome, report, run_name)
        registry.set_champion(version.version)
    env = {**_bare_env(), "FLEETLOOP_ROOT": str(root)}
    (root / "params.yaml").write_text(yaml.safe_dump(settings.model_dump(mode="json", exclude={"root": True, "runtime": {"tokens"}})))
    lineage = _verbatim(".venv/bin/fleetloop lineage champion", REPO, env)
    assert "version" in lineage and "snapshot" in lineage
    rolled = _verbatim(".venv/bin/fleetloop rollback", REPO, env)
    assert "champion: 1" in rolled
    rebuilt = _verbatim(".venv/bin/fleetloop reproduce champion", REPO, env)
    assert "v1 reproduced: same weights" in rebuilt, rebuilt
