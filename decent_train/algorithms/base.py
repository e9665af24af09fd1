"""The protocol the training loop calls, whatever the algorithm, and the registry that picks one by name.

An algorithm owns the model's wrapper, the optimizer (or the engine that holds it) and all state of its own; the loop
only calls the methods below, so it never asks which algorithm runs. Adding one is a module with a class registered
here plus ``conf/algorithm/<name>.yaml``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from decent_train.components.checkpoint import ShardedState
from decent_train.components.metrics import ConsensusProbe
from decent_train.config import ALGORITHM_TRAITS, AlgorithmTraits, TrainConfig, register_algorithm
from decent_train.engine.membership import local_part
from decent_train.engine.optimizers import LRSchedulerFn


class Algorithm(ABC):
    """One way to train data-parallel workers, built over the bare model ``net`` by ``__init__``.

    The loop, per optimizer step: ``begin_step``; for each micro-batch ``model(x)`` and backward (all but the last
    under ``no_sync()``); then ``step()``. Evaluation runs under ``averaged()``; ``average()`` ends training. The
    abstract methods are those where a silent default would train or evaluate the wrong model.
    """

    name: ClassVar[str]  # set by @register: the ``algorithm=`` value
    model: nn.Module  # what forward is called on: the wrapper whose backward communicates
    net: nn.Module  # the bare module: what checkpoints hold, evaluation runs and the final model is
    phase: int = 0  # the index of the running phase in ``cfg.phases`` (0 without phases)

    @abstractmethod
    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int
    ) -> None:
        """Wrap ``net`` (already on its device, equal on every worker) with the optimizer ``cfg.optim``, the learning
        rate schedule ``schedule`` and ``scaler`` (fp16 loss scaling; disabled otherwise); ``steps_taken`` > 0 when
        resuming, before ``load_state_dict``."""

    @property
    def phase_name(self) -> str:
        """What the running phase does (a topology, or "allreduce"): named in the records and the log."""
        return self.name

    @property
    def topology_name(self) -> str | None:
        """The topology the workers mix over, for ``result.json``; None when they do not gossip."""
        return None

    def begin_step(self, steps_taken: int) -> bool:
        """Called before each step, ``steps_taken`` steps into the run: enter the next phase if it starts here;
        whether it did (the loop logs it)."""
        return False

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Around a micro-batch that is not the step's last: accumulate its gradients without communicating."""

    @abstractmethod
    def step(self) -> None:
        """After the step's last backward: whatever of the optimizer step did not happen inside backward."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This worker's algorithm state for its checkpoint (the model's own ``state_dict`` is saved beside it)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output, or from an average of several workers' (then it holds the key
        ``averaged_from``)."""

    @staticmethod
    @abstractmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        """What of one worker's saved ``state_dict()`` enters the average that workers at another world size resume
        from: nothing in flight, nothing only that worker can use."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate of the step just taken."""

    @abstractmethod
    def bytes_per_step(self) -> float:
        """Bytes this worker sends per optimizer step (averaged over whatever period the algorithm repeats)."""

    def comm_wait_seconds(self) -> float | None:
        """Seconds spent so far blocked on peers, or None when the algorithm cannot tell them from compute."""
        return None

    def late_buckets(self) -> int | None:
        """Buckets so far whose update could have overlapped backward but waited for its end (the engine updates
        buckets strictly in order: a late gradient holds back the later ones); None where nothing updates in
        backward."""
        return None

    def info(self) -> dict[str, Any]:
        """Facts logged once at the start of the run (layouts, topology)."""
        return {}

    def metrics(self) -> dict[str, Any]:
        """Values of the algorithm's own added to each record; every rank calls it at the same steps."""
        return {}

    @abstractmethod
    def averaged(self) -> contextlib.AbstractContextManager[None]:
        """While open, ``net`` holds the global average of the workers' models (evaluation); the local models come
        back afterwards."""

    @abstractmethod
    def average(self) -> None:
        """Replace every worker's model by the global average for good (the end of training)."""

    def optimizers(self) -> list[Optimizer]:
        """The optimizers whose state this worker holds (the records' memory)."""
        return []

    def consensus_probe(self, samples: int, seed: int) -> ConsensusProbe:
        """What the records' ``consensus/distance`` is measured with: the workers' trainable parameters (what this
        rank holds of them)."""
        return self.consensus_over([local_part(p) for p in self.net.parameters() if p.requires_grad], samples, seed)

    def consensus_over(self, tensors: list[Tensor], samples: int, seed: int) -> ConsensusProbe:
        """How far apart the workers' ``tensors`` are (a sharded model's: its replicas', from their shards)."""
        return ConsensusProbe(tensors, samples, seed=seed)

    @property
    def lockstep_group(self) -> dist.ProcessGroup | None:
        """Ranks that must run the same number of forward passes (a sharded model's replica); None: each its own."""
        return None

    def full_state_dict(self) -> dict[str, Tensor]:
        """The model's state on the CPU for ``model.pt`` on rank 0 (empty elsewhere); every rank calls it (a sharded
        model gathers)."""
        if dist.get_rank() != 0:
            return {}
        return {k: v.cpu() for k, v in self.net.state_dict().items()}

    def sharded_state(self) -> ShardedState | None:
        """What torch.distributed.checkpoint saves per replica (a sharded model and its optimizer state); None:
        ``net.state_dict()`` and ``state_dict()`` hold everything, in this worker's file."""
        return None

    def load_sharded_state(self, directory: Path, replicas: list[int]) -> None:
        """Continue from ``sharded_state()``'s save in ``directory`` (several ``replicas``: their average)."""
        raise NotImplementedError(f"algorithm={self.name} saves no sharded state")

    def prepare_membership_change(self) -> None:
        """Live membership: between steps, before the default group is reconfigured (nothing may be in flight)."""
        raise NotImplementedError(f"algorithm={self.name} does not support live membership changes")

    def membership_changed(self, topology: str, local_world_size: int) -> None:
        """Live membership: the default group has new members; go on over ``topology`` built over them."""
        raise NotImplementedError(f"algorithm={self.name} does not support live membership changes")


ALGORITHMS: dict[str, type[Algorithm]] = {}  # the ``algorithm=`` name -> its class

T = TypeVar("T", bound=Algorithm)


def register(name: str, traits: AlgorithmTraits | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator: make the class ``algorithm=name``. ``traits`` tell the config's checks (which sit below this
    package) its options' schema and whether it gossips; the built-in algorithms' are in ``config.ALGORITHM_TRAITS``.
    """

    def add(cls: type[T]) -> type[T]:
        if name in ALGORITHMS:
            raise ValueError(f"two algorithms registered as {name!r}: {ALGORITHMS[name].__name__}, {cls.__name__}")
        cls.name = name
        ALGORITHMS[name] = cls
        if traits is not None or name not in ALGORITHM_TRAITS:
            register_algorithm(name, traits or AlgorithmTraits())
        return cls

    return add


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name``."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm={name!r} is not an algorithm; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]
