"""Optimizer and learning-rate schedule configs, turned into the engine's per-bucket factories."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from decent_train.components.checks import refuse_unread, refusing_unread, schema_default
from decent_train.engine.optimizers import (
    LRSchedulerFn,
    OptimFn,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
    optim_fn_sgd,
)

OPTIMIZERS = {
    "accum_adamw": optim_fn_accum_adamw,
    "accum_adam": optim_fn_accum_adam,
    "adamw": optim_fn_adamw,
    "adam": optim_fn_adam,
    "sgd": optim_fn_sgd,
}
ADAMS = ("accum_adamw", "accum_adam", "adamw", "adam")
# optim.<key> -> the optimizers that read it (all read lr and weight_decay)
OPTIM_READERS = {"beta1": ADAMS, "beta2": ADAMS, "eps": ADAMS, "accum_iter": ("accum_adamw", "accum_adam"),
                 "momentum": ("sgd",), "nesterov": ("sgd",)}
SCHEDULER_NAMES = ("cosine", "constant")
WARMUP_KEYS = ("warmup_steps", "warmup_epochs", "warmup_fraction")  # the first of them set (> 0) is the warmup
# scheduler.<key> -> the schedules that read it: set away from its default under another, it is refused.
SCHEDULER_READERS = {key: ("cosine",) for key in (*WARMUP_KEYS, "warmup_start", "min_lr")}


@dataclass
class OptimConfig:
    """``conf/optim/*.yaml``. Weight decay applies to tensors of 2 or more dimensions only (not biases, norms)."""

    name: str = "accum_adamw"
    lr: float = 3e-3  # the learning rate (the schedule's peak)
    weight_decay: float = 0.1  # on weights only (not biases and norms); decoupled in adamw and accum_adamw
    beta1: float = 0.9  # adam, adamw, accum_adam, accum_adamw: the first moment's decay
    beta2: float = 0.999  # adam, adamw, accum_adam, accum_adamw: the second moment's decay
    eps: float = 1e-8  # adam, adamw, accum_adam, accum_adamw: added to the denominator
    accum_iter: int = 4  # accum_adam, accum_adamw: iterations whose updates AccumAdam accumulates
    momentum: float = 0.9  # sgd: the momentum
    nesterov: bool = False  # sgd: Nesterov's momentum

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name={self.name!r} is not an optimizer; valid: {', '.join(OPTIMIZERS)}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if self.accum_iter < 1:
            raise ValueError(f"optim.accum_iter={self.accum_iter} must be >= 1")
        for key in ("beta1", "beta2", "momentum"):  # else torch refuses them in every worker, in a traceback
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        if self.eps < 0:
            raise ValueError(f"optim.eps={self.eps} must be >= 0")
        if self.name == "sgd" and self.nesterov and self.momentum == 0:
            raise ValueError("optim.nesterov=true needs optim.momentum > 0 (or set optim.nesterov=false)")
        refuse_unread("optim", self, OPTIM_READERS)


@dataclass
class SchedulerConfig:
    """``conf/scheduler/*.yaml``: ``cosine`` (linear warmup, then cosine decay to ``min_lr``) or ``constant``."""

    name: str = "cosine"
    warmup_steps: int = 0  # cosine: steps of linear warmup; 0: set by warmup_epochs, else warmup_fraction
    warmup_epochs: float = 0.0  # cosine, warmup_steps=0: epochs of warmup; 0: warmup_fraction decides
    warmup_fraction: float = 0.05  # cosine, warmup_steps=0, warmup_epochs=0: the warmup's share of the run's steps
    warmup_start: float = 0.01  # cosine: the warmup starts at this fraction of the learning rate
    min_lr: float = 1e-6  # cosine: the learning rate the decay ends at

    def __post_init__(self) -> None:
        if self.name not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler.name={self.name!r} is not a schedule; valid: {', '.join(SCHEDULER_NAMES)}")
        if self.warmup_steps < 0 or self.warmup_epochs < 0 or not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(
                f"scheduler.warmup_steps={self.warmup_steps} and scheduler.warmup_epochs={self.warmup_epochs} must be "
                f">= 0, scheduler.warmup_fraction={self.warmup_fraction} in [0, 1)"
            )
        if not 0.0 < self.warmup_start <= 1.0:
            raise ValueError(f"scheduler.warmup_start={self.warmup_start} must be in (0, 1]")
        refuse_unread("scheduler", self, SCHEDULER_READERS)
        if refusing_unread():
            self._check_warmup_keys()

    def _check_warmup_keys(self) -> None:
        """The first of ``WARMUP_KEYS`` above 0 sets the warmup: another set too is never read (a fraction left at
        its default or 0 passes), nor is ``warmup_start`` when all are 0."""
        first, *later = [key for key in WARMUP_KEYS if getattr(self, key) > 0] or [None]
        for key in later:
            if getattr(self, key) != schema_default(SchedulerConfig, key):
                raise ValueError(
                    f"scheduler.{key}={getattr(self, key)} with scheduler.{first}={getattr(self, first)}: {first} sets "
                    f"the warmup, and {key} is read only when {first}=0; set one of them to 0"
                )
        start = schema_default(SchedulerConfig, "warmup_start")
        if first is None and self.warmup_start != start:
            raise ValueError(
                f"scheduler.warmup_start={self.warmup_start}: there is no warmup (scheduler.warmup_steps, "
                "warmup_epochs and warmup_fraction are 0); set one of them, or leave scheduler.warmup_start="
                f"{start}"
            )

    def check_run(self, steps: int, epochs: float) -> None:
        """Refuse a warmup as long as the run or longer (``steps``: the run's optimizer steps in all, a resumed run's
        too; 0: ``epochs`` epochs): it would be cut to the run's steps but one, with no decay after it. A warmup and
        a run counted in different units (warmup_steps with epochs, warmup_epochs with steps) pass: the steps of an
        epoch are counted in the worker (the data's size, the world size the run started with)."""
        if self.name != "cosine":
            return
        if steps and self.warmup_steps >= steps:
            raise ValueError(
                f"scheduler.warmup_steps={self.warmup_steps} with steps={steps}: the warmup would take the whole run "
                f"(cut to {steps - 1} steps, no decay after it); valid: scheduler.warmup_steps in 0..{steps - 1}"
            )
        if not steps and not self.warmup_steps and self.warmup_epochs >= epochs:
            raise ValueError(
                f"scheduler.warmup_epochs={self.warmup_epochs} with epochs={epochs}: the warmup would take the whole "
                f"run (no decay after it); valid: scheduler.warmup_epochs < {epochs}"
            )


def make_optim_fn(cfg: OptimConfig) -> OptimFn:
    """The engine's optimizer factory (one optimizer per bucket; also used whole-model for all-reduce)."""
    if cfg.name == "sgd":
        return partial(optim_fn_sgd, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    kwargs = dict(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name.startswith("accum_"):
        kwargs["accum_iter"] = cfg.accum_iter
    return partial(OPTIMIZERS[cfg.name], **kwargs)


def make_scheduler_fn(cfg: SchedulerConfig, total_steps: int, steps_per_epoch: int = 1) -> LRSchedulerFn:
    """The engine's LR-schedule factory for a run of ``total_steps`` optimizer steps."""
    if cfg.name == "constant":
        return _constant
    warmup = cfg.warmup_steps or round(cfg.warmup_epochs * steps_per_epoch) or int(cfg.warmup_fraction * total_steps)
    warmup = min(warmup, total_steps - 1)
    return partial(
        lr_scheduler_fn_cosine_with_warmup,
        t_max=max(1, total_steps - warmup),
        t_warmup=warmup,
        cosine_eta_min=cfg.min_lr,
        warmup_decay=cfg.warmup_start,
    )


def _constant(optimizer: Optimizer) -> LRScheduler:
    return LambdaLR(optimizer, lambda step: 1.0)
