"""Expert-parallel training on two "hosts": two torchrun launchers, each in its own working directory
(node 1's holds no data), meet at a c10d rendezvous on 127.0.0.1 (1 gloo process each, world 2)
and train what `torchrun --standalone` trains with 2 processes on one host, bit for bit; a node
started with other params stops both with the field named; a node whose peer never comes gives up
after distributed.rdzv_timeout_s with a one-line error."""

from __future__ import annotations

import hashlib
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from components.config import DistributedConfig, ShuffleConfig, TrainConfig
from components.training.expert_parallel import ExpertParallelError, launch_expert_parallel
from tests.test_moe import POLICY, _dataset, _init_state

TRAIN = TrainConfig(batch_size=64, epochs=1, lr=3e-3, world_size=2)
STEPS = 4
LAUNCH_TIMEOUT_S = 240  # a stuck run fails the test instead of hanging it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(root: Path, node_rank: int, port: int, **overrides) -> DistributedConfig:
    return DistributedConfig(nnodes=2, node_rank=node_rank, rdzv_endpoint=f"127.0.0.1:{port}",
                             rdzv_id=f"test-{root.name}", **overrides)


def _launch(workdir: Path, distributed: DistributedConfig, data: Path | None = None, init: Path | None = None,
            train: TrainConfig = TRAIN):
    return launch_expert_parallel(data, workdir / "model.pt", POLICY, train, ShuffleConfig(), seed=7, max_steps=STEPS,
                                  timeout_s=LAUNCH_TIMEOUT_S, init_path=init, distributed=distributed)


def _two_nodes(tmp_path: Path, node1_train: TrainConfig = TRAIN, standalone: bool = False) -> tuple[Path, list]:
    """Node 0 (with the data and starting weights) and node 1 (an empty folder), launched together,
    and with ``standalone`` the one-host reference beside them (its own copy of the inputs): each
    outcome is the result, or the exception its launcher raised."""
    host0, host1, single = tmp_path / "host0", tmp_path / "host1", tmp_path / "single"
    for folder in (host0, host1, single):
        folder.mkdir()
    data, init = _dataset(host0 / "data.npz"), _init_state(host0 / "init.pt")
    port = _free_port()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_launch, host0, _node(tmp_path, 0, port), data, init),
                   pool.submit(_launch, host1, _node(tmp_path, 1, port), train=node1_train)]
        if standalone:
            futures.append(pool.submit(_launch, single, DistributedConfig(), shutil.copy(data, single / "data.npz"),
                                       shutil.copy(init, single / "init.pt")))
    return data, [f.exception() or f.result() for f in futures]


@pytest.mark.slow
def test_two_nodes_train_what_one_host_trains(tmp_path: Path) -> None:
    data, (node0, node1, standalone) = _two_nodes(tmp_path, standalone=True)
    assert standalone.world_size == node0.world_size == node1.world_size == 2
    assert node0.losses == node1.losses == standalone.losses and len(node0.losses) == STEPS  # exact
    assert node0.expert_share == standalone.expert_share and node0.dropped_rate == standalone.dropped_rate
    assert node0.shuffle_bytes_sent > 0  # experts really were on the other node
    # node 1 trained on node 0's bytes and keeps no model: node 0 saved it, as the single host's rank 0 did
    assert node1.data_sha256 == node0.data_sha256 == hashlib.sha256(data.read_bytes()).hexdigest()
    assert node1.state_dict_path is None and not (tmp_path / "host1" / "model.pt").exists()
    assert (node0.node_rank, node1.node_rank) == (0, 1)
    two_hosts, one_host = torch.load(node0.state_dict_path), torch.load(standalone.state_dict_path)
    assert two_hosts.keys() == one_host.keys()
    assert all(torch.equal(two_hosts[k], one_host[k]) for k in one_host)  # bit for bit


def test_a_node_with_other_params_stops_both_naming_the_field(tmp_path: Path) -> None:
    _, outcomes = _two_nodes(tmp_path, node1_train=TRAIN.model_copy(update={"lr": 1e-3}))
    for node, outcome in enumerate(outcomes):
        assert isinstance(outcome, ExpertParallelError), outcome
        assert str(outcome).startswith(f"node {node}: the nodes were started with different params: "
                                       "train.lr: node 1 has 0.001, node 0 has 0.003. Fix: "), outcome


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all bound at once, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _launch_alone(tmp_path: Path, node_rank: int, port: int) -> ExpertParallelError | None:
    """Node ``node_rank`` of two, started in its own folder on a port nobody else joins: the error
    its launcher raised (None if it raised none)."""
    folder = tmp_path / f"alone-{node_rank}"
    folder.mkdir()
    alone = _node(folder, node_rank, port, rdzv_timeout_s=2)
    try:
        _launch(folder, alone, _dataset(folder / "data.npz") if node_rank == 0 else None)
    except ExpertParallelError as error:
        return error
    return None


def test_a_node_whose_peer_never_comes_times_out(tmp_path: Path) -> None:
    """Node 0 and node 1, each alone (at once: the two waits overlap), give up with the one-line error."""
    ranks = (0, 1)
    with ThreadPoolExecutor(len(ranks)) as pool:
        errors = dict(zip(ranks, pool.map(_launch_alone, [tmp_path] * len(ranks), ranks, _free_ports(len(ranks)))))
    for node_rank, error in errors.items():
        assert isinstance(error, ExpertParallelError), (node_rank, error)
        assert re.search(rf"^node {node_rank}: rendezvous .* not all distributed.nnodes=2 nodes joined within "
                         r"distributed.rdzv_timeout_s=2 s\. Fix: start the", str(error)), (node_rank, str(error))


NODE0_COMMAND = ".venv/bin/fleetloop stage train"  # docs/operations.md, "Expert-parallel training on several hosts"
NODE1_COMMAND = ".venv/bin/fleetloop train-node --node-rank 1"


@pytest.mark.slow
def test_documented_two_host_commands_verbatim(tmp_path: Path) -> None:
    """docs/operations.md's two commands, verbatim, one per "host" (own root, own working directory,
    the same params.yaml): node 0 trains the dvc stage's model, node 1 joins with nothing on disk."""
    import os
    import subprocess
    import sys

    import yaml

    from components.config import DistributedConfig, PolicyConfig
    from components.pipeline.dvc_stages import run_stage
    from tests.conftest import small_settings
    from tests.test_dvc_repro import documented_commands

    assert {NODE0_COMMAND, NODE1_COMMAND} <= set(documented_commands())
    moe = PolicyConfig(kind="moe_transformer", d_model=16, heads=2, hidden=16, layers=1, num_experts=4, top_k=2, history=4)
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    settings = small_settings(host0, policy=moe, train=TrainConfig(method="filtered_bc", epochs=1, batch_size=32, world_size=2),
                              distributed=DistributedConfig(nnodes=2, rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_timeout_s=120))
    run_stage("collect", settings)  # node 0's data (dvc repro's first stages); node 1 gets none
    run_stage("ingest", settings)
    params = yaml.safe_dump(settings.model_dump(mode="json", exclude={"root": True, "runtime": {"tokens"}}))
    procs = {}
    for host, command in ((host0, NODE0_COMMAND), (host1, NODE1_COMMAND)):
        host.mkdir(exist_ok=True)
        (host / "params.yaml").write_text(params)
        (host / ".venv").symlink_to(Path(sys.executable).parent.parent)  # where `make` puts it
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "FLEETLOOP_ROOT")}
        env.update(FLEETLOOP_ROOT=str(host), OMP_NUM_THREADS="1")
        procs[host] = subprocess.Popen(["bash", "-c", command], cwd=host, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {host: proc.communicate(timeout=LAUNCH_TIMEOUT_S) for host, proc in procs.items()}
    for host, proc in procs.items():
        assert proc.returncode == 0, f"{host.name} failed:\n{out[host][0]}\n{out[host][1]}"
    assert "plan sequential x 2 torchrun ranks on 2 hosts" in out[host0][0]
    trained = yaml.safe_load((host0 / "metrics" / "train.json").read_text())
    assert (host0 / "build" / "model" / "policy.pt").exists() and trained["steps"] > 0
    assert f"train-node: node 1 of 2 trained {trained['steps']} steps in a world of 2 ranks" in out[host1][0]
    assert not (host1 / "build").exists()  # node 1 had no data and keeps no model


def test_distributed_settings_name_the_field_and_follow_the_hosts() -> None:
    from pydantic import ValidationError

    from components.config import Settings
    from components.training.multinode import shuffle_for_topology

    with pytest.raises(ValidationError, match="train.world_size=3 must be a multiple of distributed.nnodes=2"):
        Settings(train=TrainConfig(world_size=3), distributed=DistributedConfig(nnodes=2))
    with pytest.raises(ValidationError, match="distributed.rdzv_endpoint='hostA' must be HOST:PORT"):
        DistributedConfig(rdzv_endpoint="hostA")
    with pytest.raises(ValidationError, match="distributed.node_rank=2 must be below distributed.nnodes=2"):
        DistributedConfig(nnodes=2, node_rank=2)
    two_hosts = DistributedConfig(nnodes=2)
    assert shuffle_for_topology(ShuffleConfig(), two_hosts, 4).ranks_per_node == 4  # the two-level plans see the hosts
    assert shuffle_for_topology(ShuffleConfig(), DistributedConfig(), 4).ranks_per_node == 0  # one host: as before
    with pytest.raises(ValueError, match="shuffle.ranks_per_node=2, but each of the distributed.nnodes=2 hosts runs 4"):
        shuffle_for_topology(ShuffleConfig(ranks_per_node=2), two_hosts, 4)
