"""``conf/launch/*.yaml``: how many workers, on what, and how the elastic agent runs them (``launcher/launch.py``
runs them; the schema lives below the launcher so that a worker loading its config never imports it); and
``conf/fault_tolerance/*.yaml``: what runs them when one fails (``launcher/supervisor.py`` under live mode)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

from decent_train.components.checks import refuse_unread

DEVICES = ("cpu", "cuda", "auto")
# torch's c10d rendezvous defaults (dynamic_rendezvous.py, c10d_rendezvous_backend.py), which the launch config's
# defaults keep.
TORCH_LAST_CALL_S, TORCH_KEEP_ALIVE_S, TORCH_STORE_TIMEOUT_S = 30, 5, 60
_NODE_RANGE = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")


@dataclass
class SlurmConfig:
    """``launch.slurm``: what each job of a SLURM sweep asks for (``-m hydra/launcher=slurm``, which reads these in
    ``conf/hydra/launcher/slurm.yaml``). ``scripts/slurm_train.sbatch`` gets its allocation from sbatch instead."""

    partition: Optional[str] = None  # the partition; null: the cluster's default
    account: Optional[str] = None  # the account charged; null: yours by default
    time_min: int = 60  # the job's time limit, minutes
    gpus_per_node: Optional[int] = None  # GPUs per node; null: none (launch=gpu starts one worker per GPU the job gets)
    cpus_per_task: Optional[int] = None  # CPUs per node (one task per node runs the torchrun agent); null: SLURM's
    mem_gb: Optional[int] = None  # memory per node; null: SLURM's default

    def __post_init__(self) -> None:
        for key in ("time_min", "gpus_per_node", "cpus_per_task", "mem_gb"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"launch.slurm.{key}={value} must be >= 1")


@dataclass
class LaunchConfig:
    """``conf/launch/*.yaml``: how many workers, on what, and how the elastic agent runs them (``launcher/launch.py``;
    the schema lives here so that a worker loading its config never imports the launcher)."""

    nproc_per_node: Optional[int] = 4  # workers per node; null: one per visible GPU
    # N nodes, or torchrun's "MIN:MAX" (elastic: the workers restart when nodes leave or join; in a YAML file quote
    # it, "1:2": YAML reads 1:2 as the base-60 number 62)
    nnodes: Union[int, str] = 1
    device: str = "cpu"  # cpu (gloo) | cuda (nccl, one GPU per worker) | auto (cuda when available)
    max_restarts: int = 0  # the agent restarts all workers this many times after a failure
    monitor_interval: float = 0.1  # fault_tolerance=none: seconds between the agent's checks of the workers
    rdzv_endpoint: str = ""  # nnodes!=1: host:port of the c10d rendezvous; empty: standalone on this node
    rdzv_id: str = ""  # nnodes!=1: the rendezvous' id, shared by the nodes; empty: a fresh one per launch
    # nnodes!=1: once MIN nodes have joined, the rendezvous waits this long for more
    rdzv_last_call_s: int = TORCH_LAST_CALL_S
    rdzv_keep_alive_s: int = TORCH_KEEP_ALIVE_S  # nnodes!=1: agents' heartbeat; a node silent for 3 of them has left
    # nnodes!=1: how long a node waits for the rendezvous store (to reach the first node's, and for each request)
    rdzv_store_timeout_s: int = TORCH_STORE_TIMEOUT_S
    threads_per_worker: Optional[int] = None  # OMP_NUM_THREADS of each worker; null: CPU cores / workers per node
    slurm: SlurmConfig = field(default_factory=SlurmConfig)  # hydra/launcher=slurm: the sweep's allocation

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ValueError(f"launch.nproc_per_node={self.nproc_per_node}: at least one worker per node is needed")
        low, high = node_range(self.nnodes)
        if low == high:
            self.nnodes = low  # "2" or "2:2": a fixed number of nodes
        if self.device not in DEVICES:
            raise ValueError(f"launch.device={self.device!r} is not a device; valid: {', '.join(DEVICES)}")
        if self.max_restarts < 0:
            raise ValueError(f"launch.max_restarts={self.max_restarts} must be >= 0")
        if not self.monitor_interval > 0:  # torch's agent asserts it, in a traceback
            raise ValueError(f"launch.monitor_interval={self.monitor_interval} must be > 0 seconds")
        if high > 1 and not (self.rdzv_endpoint and self.rdzv_id):
            # Each node's agent must find the others: the same endpoint and the same id (a fresh one per launch, or a
            # free port of its own, would leave every agent in a world of its own).
            raise ValueError(
                f"launch.nnodes={self.nnodes} needs launch.rdzv_endpoint=HOST:PORT (the first node) and "
                "launch.rdzv_id=ID, the same for every node"
            )
        for key in ("rdzv_last_call_s", "rdzv_keep_alive_s", "rdzv_store_timeout_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"launch.{key}={getattr(self, key)} must be >= 1 (whole seconds)")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"launch.threads_per_worker={self.threads_per_worker} must be >= 1")

    @property
    def min_nodes(self) -> int:
        return node_range(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return node_range(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """Nodes may leave (down to ``min_nodes``) or join (up to ``max_nodes``) while the job runs."""
        return self.min_nodes != self.max_nodes

    @property
    def world_sizes(self) -> list[int]:
        """Every number of workers the job may train with, smallest first: what the config must work for."""
        assert self.nproc_per_node is not None, "nproc_per_node is resolved by the launcher"
        return [k * self.nproc_per_node for k in range(self.min_nodes, self.max_nodes + 1)]

    @property
    def world_size(self) -> int:
        """The number of workers with every node joined (``max_nodes``). An elastic job trains with any of
        :attr:`world_sizes` at a time: checks go over all of them, and a worker's is ``dist.get_world_size()``."""
        return self.world_sizes[-1]


def node_range(nnodes: Union[int, str]) -> tuple[int, int]:
    """``launch.nnodes`` as ``(MIN, MAX)`` nodes: ``N`` is ``(N, N)``, ``"MIN:MAX"`` torchrun's elastic range."""
    match = _NODE_RANGE.fullmatch(str(nnodes))
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= low <= high:
        raise ValueError(
            f"launch.nnodes={nnodes} is not a number of nodes; valid: N >= 1, or MIN:MAX with 1 <= MIN <= MAX "
            "(elastic, e.g. 1:4)"
        )
    return low, high


FAULT_TOLERANCE = ("none", "live")
LIVE_ROLES = ("both", "coordinator", "agent")  # fault_tolerance.role


def host_port(address: str) -> bool:
    """``address`` is HOST:PORT with a port in 1..65535."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


FAULT_TOLERANCE_READERS = dict.fromkeys(("detect_s", "min_workers", "role"), ("live",))  # key -> who reads it


@dataclass
class FaultToleranceConfig:
    """``conf/fault_tolerance/*.yaml``. ``none``: a failed worker stops every worker (torchrun restarts them all
    from the newest checkpoint with ``launch.max_restarts``). ``live``: the others go on without it and a
    replacement heals from a live peer (``training/live.py``; the design: ``docs/fault-tolerance.md``)."""

    name: str = "none"
    # live: a worker or a node silent this long (hung, stopped, cut off) is declared dead; at least 2 s (a healthy
    # member ending its run is silent longer than its 0.1 s beat)
    detect_s: float = 10.0
    min_workers: int = 1  # live: below this many the run stops, with a checkpoint
    # live: what this launch runs: both, coordinator or agent. both: the coordinator (the store and the plans) and
    # this node's agent (its workers); coordinator: the coordinator alone (a host that does not train); agent: this
    # node's agent, for the coordinator at launch.rdzv_endpoint (the job is the coordinator's). Several nodes:
    # docs/fault-tolerance.md
    role: str = "both"

    def __post_init__(self) -> None:
        if self.name not in FAULT_TOLERANCE:
            raise ValueError(f"fault_tolerance={self.name!r}; valid: {', '.join(FAULT_TOLERANCE)}")
        if self.detect_s <= 0:
            raise ValueError(f"fault_tolerance.detect_s={self.detect_s} must be > 0 seconds")
        if self.min_workers < 1:
            raise ValueError(f"fault_tolerance.min_workers={self.min_workers} must be >= 1")
        if self.role not in LIVE_ROLES:
            raise ValueError(f"fault_tolerance.role={self.role!r}; valid: {', '.join(LIVE_ROLES)}")
        refuse_unread("fault_tolerance", self, FAULT_TOLERANCE_READERS)

    @property
    def live(self) -> bool:
        return self.name == "live"
