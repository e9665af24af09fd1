"""decent_train: decentralized data-parallel training for PyTorch.

``from decent_train import DecentralizedDataParallel`` replaces ``decent_dp``'s class. Scripts that import decent-dp's
submodules keep working after renaming the package: ``decent_train.ddp``, ``decent_train.optim``,
``decent_train.topo`` and ``decent_train.utils`` are the engine's modules under decent-dp's names (engine/compat.py).

A library stays silent in its user's script: the package's loguru messages are off until asked for with
``loguru.logger.enable("decent_train")``. The ``decent-train`` command and its workers turn them on.
"""

from loguru import logger

logger.disable("decent_train")  # before any submodule is imported: none of them logs when imported either

from decent_train.engine import *  # noqa: F403
from decent_train.engine import __all__ as _engine_all
from decent_train.engine.compat import alias_decent_dp_modules

alias_decent_dp_modules(__name__)

__all__ = [*_engine_all, "DiLoCo", "LocalSGD", "Gossip", "load_model"]


def __getattr__(name: str) -> object:
    """The step-hook fronts (algorithms/local_steps.py, algorithms/step_gossip.py) and ``load_model``, imported when
    first asked for: the engine's import stays light."""
    if name in ("DiLoCo", "LocalSGD"):
        from decent_train.algorithms import local_steps

        return getattr(local_steps, name)
    if name == "load_model":  # the trained model a run left (training/saved_model.py)
        from decent_train.training.saved_model import load_model

        return load_model
    if name == "Gossip":
        from decent_train.algorithms import step_gossip

        return step_gossip.Gossip
    raise AttributeError(f"module 'decent_train' has no attribute {name!r}")
__version__ = "0.1.0"
