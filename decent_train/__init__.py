"""decent_train: decentralized data-parallel training for PyTorch.

``from decent_train import DecentralizedDataParallel`` replaces ``decent_dp``'s class. Scripts that import decent-dp's
submodules keep working after renaming the package: ``decent_train.ddp``, ``decent_train.optim``,
``decent_train.topo`` and ``decent_train.utils`` are the engine's modules under decent-dp's names.
"""

import sys

from decent_train.engine import *  # noqa: F403
from decent_train.engine import __all__ as _engine_all
from decent_train.engine import ddp, optim, topology, utils

for _alias, _module in {"ddp": ddp, "optim": optim, "topo": topology, "utils": utils}.items():
    sys.modules[f"{__name__}.{_alias}"] = _module
topo = topology

__all__ = list(_engine_all)
__version__ = "0.1.0"
