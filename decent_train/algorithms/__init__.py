"""Training algorithms: the protocol the loop calls (``base.Algorithm``) and its implementations, registered by the
``algorithm=`` name they answer to (``ALGORITHMS``). Importing this package registers them all."""

from decent_train.algorithms import allreduce, decentralized, local_steps_algorithms
from decent_train.algorithms.base import ALGORITHMS, Algorithm, algorithm_class, register

__all__ = [
    "ALGORITHMS", "Algorithm", "algorithm_class", "register", "allreduce", "decentralized", "local_steps_algorithms",
]
