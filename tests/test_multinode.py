"""Expert-parallel training on two "hosts": two torchrun launchers, each in its own working directory
(node 1's holds no data), meet at a c10d rendezvous on 127.0.0.1 (1 gloo process each, world 2)
and train what `torchrun --standalone` trains with 2 processes on one host, bit for bit; a node
started with other params stops both with the field named; a node whose peer never comes gives up
after distributed.rdzv_timeout_s with a one-line error."""

from __future__ import annotations

import hashlib
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


def test_a_node_whose_peer_never_comes_times_out(tmp_path: Path) -> None:
    alone = _node(tmp_path, 0, _free_port(), rdzv_timeout_s=2)
    with pytest.raises(ExpertParallelError, match=r"^node 0: rendezvous .* not all distributed.nnodes=2 nodes joined "
                                                  r"within distributed.rdzv_timeout_s=2 s\. Fix: start the other hosts"):
        _launch(tmp_path, alone, _dataset(tmp_path / "data.npz"))
