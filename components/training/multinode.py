"""Expert-parallel training over several hosts: the torchrun command, what the nodes must agree on,
and how node 0's training set reaches the others.

    params (policy, train, shuffle, seed, nnodes) on every node
      -> torchrun --nnodes=K --rdzv-backend=c10d ... on every host (``torchrun_args``)
      -> every rank all-gathers (node rank, has data, params); any field that differs from node 0's
         stops every rank with that field named (``agree_on_run`` -> ``NodeMismatchError``)
      -> node 0's first rank broadcasts the training set (.npz bytes) and starting weights
         (``share_inputs``): a host without shared disk or store access trains on node 0's bytes.

Why node 0 sends the data rather than every node rebuilding it from the stores: building it is the
expensive part (FERT divergence + retrieval) and would run K times; a node reading the stores a
moment later could see a newer store version (ingest runs on its own schedule); and the other hosts
then need no access to the dataset, LanceDB or MLflow at all: code + params.yaml is enough. The
bytes cross the network once (tens of MB for a million frames), small beside the shuffle's traffic.

Why c10d and not ``--master-addr/--master-port``: torchrun's docs recommend the c10d rendezvous
for multi-node jobs, fixed-size ones included ("fault tolerant, fixed sized number of workers");
it needs no separate store, has a join timeout (``rdzv_timeout_s``: a missing peer is an error,
not a hang) and a run id (two jobs on one port never merge). Its rendezvous orders nodes by host
name, not by ``--node-rank`` (only the static backend reads it; not passed), so nothing here
assumes global rank 0 is node 0: the ranks find node 0's first rank (``source``) themselves; it
sends the data and saves the model, where the loop that launched it reads it. On one host it is
global rank 0, as before.

Trust: the claims and inputs travel as pickled objects (torch's ``all_gather_object`` /
``broadcast_object_list``, device-agnostic: gloo and NCCL), so the hosts of one job trust each other,
as torchrun's own store already requires: keep ``rdzv_endpoint`` on a private network.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from components.config import REPO_ROOT, DistributedConfig, PolicyConfig, ShuffleConfig, TrainConfig

PER_HOST_FIELDS = ("node_rank", "local_addr", "socket_ifname", "rdzv_timeout_s")  # may differ between hosts
ERROR_MARKER = "fleetloop-node-error: "  # a worker's one-line error on stderr, picked up by the launcher
SAME_PARAMS_FIX = ("start every node with the same params.yaml and code (only distributed."
                   + ", distributed.".join(PER_HOST_FIELDS) + " may differ per host)")


class NodeMismatchError(ValueError):
    """The nodes of one training job were started differently: it names the field and the nodes."""


@dataclass(frozen=True)
class NodeInputs:
    """What a rank trains on: node 0's training set (.npz bytes) and starting weights (or None)."""

    data: bytes
    init: bytes | None

    @property
    def data_sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def torchrun_args(distributed: DistributedConfig, nproc: int) -> list[str]:
    """The launcher flags: ``--standalone`` on one host, the c10d rendezvous across hosts. No
    ``--node-rank``: c10d ignores it (torchrun warns so); the node rank goes to the worker instead."""
    if distributed.nnodes == 1:
        return ["--standalone", f"--nproc-per-node={nproc}"]
    timeout = distributed.rdzv_timeout_s  # read_timeout too: a node started first waits that long for the store
    return [
        f"--nnodes={distributed.nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={distributed.rdzv_endpoint}", f"--rdzv-id={distributed.rdzv_id}",
        f"--rdzv-conf=join_timeout={timeout},read_timeout={timeout}", f"--local-addr={distributed.local_addr}",
    ]


def shuffle_for_topology(shuffle: ShuffleConfig, distributed: DistributedConfig, nproc: int) -> ShuffleConfig:
    """``shuffle.ranks_per_node`` as the job really runs: the processes per host when hosts > 1."""
    if distributed.nnodes == 1:
        return shuffle
    if shuffle.ranks_per_node not in (0, nproc):
        raise ValueError(
            f"shuffle.ranks_per_node={shuffle.ranks_per_node}, but each of the distributed.nnodes="
            f"{distributed.nnodes} hosts runs {nproc} processes: set it to 0 (follows the hosts) or {nproc}")
    return shuffle.model_copy(update={"ranks_per_node": nproc})


def code_digest() -> str:
    """sha256 over the components package's sources: two hosts on different code train differently."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "components").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_spec(policy: PolicyConfig, train: TrainConfig, shuffle: ShuffleConfig, seed: int, max_steps: int | None,
             nnodes: int) -> dict[str, Any]:
    """Every setting the ranks' arithmetic depends on, flat (``train.lr``), to compare across nodes."""
    spec: dict[str, Any] = {"seed": seed, "max_steps": max_steps, "distributed.nnodes": nnodes,
                            "code": code_digest(), "torch": torch.__version__}
    for section, cfg in (("policy", policy), ("train", train), ("shuffle", shuffle)):
        spec.update({f"{section}.{key}": value for key, value in cfg.model_dump(mode="json").items()})
    return spec


def agree_on_run(spec: dict[str, Any], node_rank: int, has_data: bool) -> int:
    """Check every rank was started as node 0's ranks were; return ``source``, node 0's first rank.

    Collective: every rank sees every rank's claim, so every rank raises the same error (no rank
    is left waiting in a collective for a peer that gave up)."""
    claims: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(claims, (node_rank, has_data, spec))
    node0 = [rank for rank, (node, _, _) in enumerate(claims) if node == 0]
    if not node0:
        raise NodeMismatchError(f"no node 0 joined the rendezvous (node ranks {sorted({c[0] for c in claims})}). "
                                "Fix: run the loop (fleetloop retrain, dvc repro) with distributed.node_rank: 0 on one host")
    source = node0[0]
    _check_node_ranks(claims, spec["distributed.nnodes"])
    without = [rank for rank in node0 if not claims[rank][1]]
    if without:
        raise NodeMismatchError(f"node 0's ranks {without} have no training set (fleetloop train-node never sends one). "
                                "Fix: give the node whose loop builds the data distributed.node_rank: 0, and the "
                                "others 1, 2, ...")
    for rank, (node, _, other) in enumerate(claims):
        differ = [key for key in sorted(set(spec) | set(other)) if other.get(key) != claims[source][2].get(key)]
        if differ:
            shown = "; ".join(f"{key}: node {node} has {other.get(key)!r}, node 0 has {claims[source][2].get(key)!r}"
                              for key in differ[:3])
            more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
            raise NodeMismatchError(f"the nodes were started with different params: {shown}{more}. Fix: {SAME_PARAMS_FIX}")
    return source


def _check_node_ranks(claims: list[Any], nnodes: int) -> None:
    """Each node rank 0..nnodes-1 held by exactly one host (its processes), none twice."""
    per_node: dict[int, int] = {}
    for node, _, _ in claims:
        per_node[node] = per_node.get(node, 0) + 1
    nproc = len(claims) // max(1, len(per_node))
    twice = sorted(node for node, count in per_node.items() if count != nproc)
    if twice or sorted(per_node) != list(range(nnodes)):
        raise NodeMismatchError(
            f"node ranks {dict(sorted(per_node.items()))} (node rank: processes) are not 0..{nnodes - 1} once each. "
            "Fix: give each host its own distributed.node_rank (fleetloop train-node --node-rank N)")


def share_inputs(source: int, mine: NodeInputs | None) -> NodeInputs:
    """Node 0's training set and starting weights, on every rank (one broadcast from ``source``)."""
    box: list[Any] = [mine if dist.get_rank() == source else None]
    dist.broadcast_object_list(box, src=source)
    return box[0]


def read_inputs(data_path: Any, init_path: Any) -> NodeInputs:
    """The bytes node 0's launcher wrote: the .npz training set, the starting state_dict (optional)."""
    return NodeInputs(data_path.read_bytes(), None if init_path is None else init_path.read_bytes())


def load_init(inputs: NodeInputs) -> dict[str, torch.Tensor] | None:
    return None if inputs.init is None else torch.load(io.BytesIO(inputs.init), weights_only=True)
