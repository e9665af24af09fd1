"""Training algorithms: the protocol the loop calls (``base.Algorithm``) and its implementations, registered by the
``algorithm=`` name they answer to (``ALGORITHMS``). Importing this package registers them all."""

from decent_train.algorithms import allreduce, decentralized, local_steps_algorithms
from decent_train.algorithms.base import ALGORITHMS, Algorithm, algorithm_class, register
from decent_train.config import TrainConfig

__all__ = [
    "ALGORITHMS", "Algorithm", "algorithm_class", "algorithm_for", "register", "allreduce", "decentralized",
    "local_steps_algorithms",
]


def algorithm_for(cfg: TrainConfig) -> type[Algorithm]:
    """The class that runs ``cfg``: ``algorithm=``'s, or its form over a sharded model (``parallel.shard`` > 1)."""
    if cfg.parallel.shard > 1:  # FSDP2's modules cost 0.6 s to import: only runs that shard import them
        from decent_train.algorithms import sharded

        return sharded.SHARDED[cfg.algorithm.name]
    return algorithm_class(cfg.algorithm.name)
