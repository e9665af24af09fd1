"""The engine: DecentralizedDataParallel, its topologies and optimizers."""

from decent_train.engine.compat import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE, initialize_dist
from decent_train.engine.ddp import ALLREDUCE, DecentralizedDataParallel, ExchangeError
from decent_train.engine.optimizers import (
    AccumAdam,
    AccumAdamW,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
    optim_fn_sgd,
)
from decent_train.engine.topology import (
    Edge,
    Topology,
    TopologyReg,
    build_topology,
    get_topology_class,
    register_topology,
    topology_names,
)

__all__ = [
    "ALLREDUCE",
    "DecentralizedDataParallel",
    "ExchangeError",
    "OPTIM_FN_TYPE",
    "LR_SCHEDULER_FN_TYPE",
    "AccumAdam",
    "AccumAdamW",
    "optim_fn_adam",
    "optim_fn_adamw",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_sgd",
    "lr_scheduler_fn_cosine_with_warmup",
    "Edge",
    "Topology",
    "TopologyReg",
    "build_topology",
    "get_topology_class",
    "register_topology",
    "topology_names",
    "initialize_dist",
]
