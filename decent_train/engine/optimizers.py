"""Optimizers, optimizer factories and learning-rate schedules for decentralized training.

In decentralized data-parallel training every worker steps on its own, small local
batch and only gossips parameters with its neighbours, so the per-step gradient is far
noisier than the global-batch gradient of all-reduce training.  Feeding that noise
straight into Adam's moment estimates makes them track the noise.  ``AccumAdam`` /
``AccumAdamW`` still update the parameters every step, but refresh the first and
second moment estimates only every ``accum_iter`` steps, from the *average* gradient
of those steps (``accum_iter`` should grow with the number of workers).

The optimizers reproduce the math and the per-parameter state layout of
``decent_dp.optim`` (decent-dp 0.2.3), so its optimizer state dicts load here.

The ``optim_fn_*`` factories turn the ``(name, parameter)`` pairs of one bucket into
an optimizer (see :data:`OptimFn`); wrap them in :func:`functools.partial` to change
hyperparameters.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

__all__ = [
    "OptimFn",
    "LRSchedulerFn",
    "AccumAdam",
    "AccumAdamW",
    "param_groups_with_weight_decay",
    "optim_fn_adam",
    "optim_fn_adamw",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_sgd",
    "lr_scheduler_fn_cosine_with_warmup",
    "accum_adam_foreach",
    "accum_adamw_foreach",
]

OptimFn = Callable[[list[tuple[str, Tensor]]], Optimizer]
"""Builds the optimizer of one bucket from its ``(name, parameter)`` pairs."""

LRSchedulerFn = Callable[[Optimizer], LRScheduler]
"""Builds the learning-rate scheduler of an optimizer."""

Params = Union[Iterable[Tensor], Iterable[dict[str, Any]]]
"""What ``torch.optim.Optimizer`` accepts: tensors or param-group dicts."""


# --------------------------------------------------------------------------------------
# AccumAdam / AccumAdamW
# --------------------------------------------------------------------------------------


def _check_hyperparameters(
    lr: float | Tensor,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    accum_iter: int,
) -> None:
    """Raise a ``ValueError`` naming the first invalid hyperparameter.

    Written as ``not (lo <= x)`` so that NaN is rejected as well.
    """
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: lr={lr!r} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas={tuple(betas)!r}: expected a pair (beta1, beta2)")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta{index + 1}={beta!r} in betas (must be in [0, 1))")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon: eps={eps!r} (must be >= 0)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay={weight_decay!r} (must be >= 0)")
    if isinstance(accum_iter, bool) or not isinstance(accum_iter, numbers.Integral) or accum_iter < 1:
        raise ValueError(f"Invalid accum_iter={accum_iter!r} (must be an integer >= 1)")


def _accum_adam_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    accum_grads: list[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    accum_iter: int,
    decoupled: bool,
) -> None:
    """One AccumAdam(W) update of tensors that all sit at the same (1-based) ``step``.

    This is the single implementation behind both optimizers; ``decoupled`` selects
    AdamW-style decay (shrink the parameters) over Adam-style L2 decay (add ``λx`` to
    the gradient).  ``grads`` are never modified.

    ``exp_avgs`` / ``exp_avg_sqs`` hold β1·m and β2·v of the last refresh, so the
    moments used this step are one EMA update with the current gradient away.
    Every ``accum_iter`` steps they are refreshed from the mean gradient ``accum_grads``.

    The fronts run this over the whole model, so its temporaries count in peak memory: it
    allocates one parameter-sized set, the denominators.  The numerator is never formed:
    ``m̃ + (1-β1)g`` over ``d`` is applied as two ``addcdiv_`` with the same ``d``, and
    L2's ``g + λx`` lives in the denominators' buffer until it is squared (scaled by
    ``sqrt(1-β2)`` first, so that a half-precision square overflows no sooner than the sum
    it joins); its ``λx`` part of the numerator is applied first, while ``x`` is still the
    old ``x``.  As in the Adam paper's efficient form, ``1/sqrt(1-β2^c)`` moves from ``d``
    into the step size, which saves a pass.
    """
    l2 = weight_decay != 0.0 and not decoupled
    if weight_decay != 0.0 and decoupled:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)

    # Second moment of this step: the stored (pre-scaled) estimate plus the current gradient.
    if l2:
        denoms = torch._foreach_add(grads, params, alpha=weight_decay)  # g + λx
        torch._foreach_add_(accum_grads, denoms, alpha=1.0 / accum_iter)
        torch._foreach_mul_(denoms, math.sqrt(1.0 - beta2))
        torch._foreach_mul_(denoms, denoms)
        torch._foreach_add_(denoms, exp_avg_sqs)
    else:
        torch._foreach_add_(accum_grads, grads, alpha=1.0 / accum_iter)
        denoms = torch._foreach_addcmul(exp_avg_sqs, grads, grads, value=1.0 - beta2)

    # Bias correction counts moment refreshes, not steps: ceil(step / accum_iter).
    # x -= lr/bc1 · m̂ / (sqrt(v̂)/sqrt(bc2) + eps)  ==  x -= step_size · m̂ / (sqrt(v̂) + eps·sqrt(bc2)).
    refreshes = (step + accum_iter - 1) // accum_iter
    bias_correction1 = 1.0 - beta1**refreshes
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**refreshes)
    step_size = lr * bias_correction2_sqrt / bias_correction1

    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps * bias_correction2_sqrt)
    # m̂ = m̃ + (1-β1)(g [+ λx]), one term at a time (elementwise, so x may be its own input).
    if l2:
        torch._foreach_addcdiv_(params, params, denoms, value=-step_size * (1.0 - beta1) * weight_decay)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-step_size)
    torch._foreach_addcdiv_(params, grads, denoms, value=-step_size * (1.0 - beta1))

    if step % accum_iter == 0:
        torch._foreach_add_(exp_avgs, accum_grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_addcmul_(exp_avg_sqs, accum_grads, accum_grads, value=1.0 - beta2)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_zero_(accum_grads)



def accum_adam_foreach(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    accum_grads: list[Tensor], state_steps: list[Tensor], beta1: float, beta2: float, lr: float | Tensor,
    weight_decay: float, eps: float, accum_iter: int,
) -> None:
    """decent-dp 0.2.3's functional AccumAdam, under its name and arguments, so that its scripts run after the import
    swap: one step of tensors that share a step count, advancing ``state_steps``. Unlike decent-dp's, the gradients
    are left as they were (it added the L2 decay into them)."""
    _decent_dp_step(params, grads, exp_avgs, exp_avg_sqs, accum_grads, state_steps, beta1, beta2, lr, weight_decay,
                    eps, accum_iter, decoupled=False)


def accum_adamw_foreach(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    accum_grads: list[Tensor], state_steps: list[Tensor], beta1: float, beta2: float, lr: float | Tensor,
    weight_decay: float, eps: float, accum_iter: int,
) -> None:
    """decent-dp 0.2.3's functional AccumAdamW, under its name and arguments (see :func:`accum_adam_foreach`)."""
    _decent_dp_step(params, grads, exp_avgs, exp_avg_sqs, accum_grads, state_steps, beta1, beta2, lr, weight_decay,
                    eps, accum_iter, decoupled=True)


def _decent_dp_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    accum_grads: list[Tensor], state_steps: list[Tensor], beta1: float, beta2: float, lr: float | Tensor,
    weight_decay: float, eps: float, accum_iter: int, decoupled: bool,
) -> None:
    if not params:
        return
    torch._foreach_add_(state_steps, 1)
    _accum_adam_foreach(params, grads, exp_avgs, exp_avg_sqs, accum_grads, step=int(state_steps[0]), lr=float(lr),
                        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, accum_iter=accum_iter,
                        decoupled=decoupled)

@dataclass
class _Batch:
    """Tensors of one param group that share a step count, device and dtype."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    accum_grads: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)


class _AccumAdamBase(Optimizer):
    """Shared implementation of :class:`AccumAdam` and :class:`AccumAdamW`.

    Subclasses only choose the kind of weight decay via ``_decoupled``; it is a class
    attribute rather than a param-group default so that state dicts saved by decent-dp
    (whose param groups lack such a key) load unchanged.
    """

    _decoupled: ClassVar[bool]

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, accum_iter)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, accum_iter=accum_iter)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validating its (possibly overridden) hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], group["accum_iter"]
        )

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        """The state of ``param``, created (zeroed, step 0) on its first update."""
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.tensor(0, dtype=torch.int64)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["accum_grad"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _batches(self, group: dict[str, Any]) -> dict[tuple[int, torch.device, torch.dtype], _Batch]:
        """Split the params of ``group`` that have a gradient into foreach batches.

        Params without a gradient are skipped and keep their step count, so counts can
        diverge inside a group; batching by step keeps each param's own bias correction
        and accumulation phase (usually there is a single batch).
        """
        batches: dict[tuple[int, torch.device, torch.dtype], _Batch] = {}
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self._state_of(param)
            key = (int(state["step"]), param.device, param.dtype)
            batch = batches.setdefault(key, _Batch())
            batch.params.append(param)
            batch.grads.append(grad)
            batch.exp_avgs.append(state["exp_avg"])
            batch.exp_avg_sqs.append(state["exp_avg_sq"])
            batch.accum_grads.append(state["accum_grad"])
            batch.steps.append(state["step"])
        return batches

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for (step, _, _), batch in self._batches(group).items():
                torch._foreach_add_(batch.steps, 1)
                _accum_adam_foreach(
                    batch.params,
                    batch.grads,
                    batch.exp_avgs,
                    batch.exp_avg_sqs,
                    batch.accum_grads,
                    step=step + 1,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    accum_iter=group["accum_iter"],
                    decoupled=self._decoupled,
                )
        return loss


class AccumAdam(_AccumAdamBase):
    """Adam whose moment estimates are refreshed every ``accum_iter`` steps from the mean gradient.

    With gradient ``g`` (plus L2 decay ``λx``), step ``t`` and ``K = accum_iter``::

        a  += g / K
        m̂  = m̃ + (1-β1) g,   v̂ = ṽ + (1-β2) g²,   c = ceil(t / K)
        x  -= lr / (1-β1^c) · m̂ / (sqrt(v̂) / sqrt(1-β2^c) + eps)
        every K steps:  m̃ = β1 (m̃ + (1-β1) a),  ṽ = β2 (ṽ + (1-β2) a²),  a = 0

    State per parameter: ``step`` (int64 CPU scalar), ``exp_avg`` (m̃), ``exp_avg_sq``
    (ṽ) and ``accum_grad`` (a), as in decent-dp.  With ``accum_iter=1`` this is Adam.
    Unlike decent-dp, ``p.grad`` is left untouched by the L2 term.

    Args:
        params: parameters or param-group dicts.
        lr: learning rate.
        betas: (β1, β2), each in [0, 1).
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty λ added to the gradient.
        accum_iter: steps per moment refresh; scale it up with the number of workers.
    """

    _decoupled = False


class AccumAdamW(_AccumAdamBase):
    """:class:`AccumAdam` with decoupled weight decay: ``x *= 1 - lr·λ`` before each update.

    With ``accum_iter=1`` this is AdamW.  Arguments as for :class:`AccumAdam`.
    """

    _decoupled = True


# --------------------------------------------------------------------------------------
# Optimizer factories
# --------------------------------------------------------------------------------------


def param_groups_with_weight_decay(params: list[tuple[str, Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """Split named parameters into a decayed and a non-decayed param group.

    Rule: tensors with ``ndim >= 2`` (linear and convolution weights, embeddings) get
    ``weight_decay``; tensors with ``ndim <= 1`` (biases, normalization scales and
    shifts, scalars) get ``0.0``, because shrinking them towards zero only fights the
    normalization and does not regularize.  The rule looks at shapes, not names, so it
    does not depend on how modules are called (decent-dp matched "bn"/"bias" in names
    and decayed exactly the wrong set).  Empty groups are left out.
    """
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def fused_on_cuda(params: list[tuple[str, Tensor]]) -> bool | None:
    """torch's fused kernel (one launch per param group, no per-parameter Python for the bias corrections) when every
    parameter is on a CUDA device, where launches and host time are what a step costs; otherwise torch's default
    (foreach), whose results the CPU replays were written against."""
    return True if params and all(p.device.type == "cuda" for _, p in params) else None


def optim_fn_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 1.0 / 32768,
    eps: float = 1e-8,
) -> Optimizer:
    """``torch.optim.Adam`` (L2 decay on weights only) for one bucket; fused on CUDA (:func:`fused_on_cuda`)."""
    return torch.optim.Adam(
        param_groups_with_weight_decay(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps,
        fused=fused_on_cuda(params),
    )


def optim_fn_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.1,
    eps: float = 1e-8,
) -> Optimizer:
    """``torch.optim.AdamW`` (decoupled decay on weights only) for one bucket; fused on CUDA (:func:`fused_on_cuda`)."""
    return torch.optim.AdamW(
        param_groups_with_weight_decay(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps,
        fused=fused_on_cuda(params),
    )


def optim_fn_accum_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1.0 / 32768,
    accum_iter: int = 4,
) -> Optimizer:
    """:class:`AccumAdam` (L2 decay on weights only) for one bucket."""
    return AccumAdam(
        param_groups_with_weight_decay(params, weight_decay),
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        accum_iter=accum_iter,
    )


def optim_fn_accum_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    accum_iter: int = 4,
) -> Optimizer:
    """:class:`AccumAdamW` (decoupled decay on weights only) for one bucket."""
    return AccumAdamW(
        param_groups_with_weight_decay(params, weight_decay),
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        accum_iter=accum_iter,
    )


def optim_fn_sgd(
    params: list[tuple[str, Tensor]],
    lr: float = 0.1,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    nesterov: bool = False,
) -> Optimizer:
    """``torch.optim.SGD`` with momentum (L2 decay on weights only) for one bucket; fused on CUDA."""
    return torch.optim.SGD(
        param_groups_with_weight_decay(params, weight_decay), lr=lr, momentum=momentum, nesterov=nesterov,
        fused=fused_on_cuda(params),
    )


# --------------------------------------------------------------------------------------
# Learning-rate schedules
# --------------------------------------------------------------------------------------


def lr_scheduler_fn_cosine_with_warmup(
    optimizer: Optimizer,
    t_max: int,
    t_warmup: int,
    cosine_eta_min: float = 1e-6,
    warmup_decay: float = 0.01,
) -> LRScheduler:
    """Linear warmup from ``warmup_decay·lr`` over ``t_warmup`` steps, then cosine annealing.

    The cosine phase decays to ``cosine_eta_min`` over ``t_max`` steps.  With
    ``t_warmup == 0`` there is no warmup phase and the plain cosine schedule is returned
    (a zero-length ``LinearLR`` inside ``SequentialLR`` would misbehave).  Wrap it in
    :func:`functools.partial` to get an :data:`LRSchedulerFn`.
    """
    if isinstance(t_max, bool) or not isinstance(t_max, numbers.Integral) or t_max < 1:
        raise ValueError(f"Invalid t_max={t_max!r} (must be an integer >= 1)")
    if isinstance(t_warmup, bool) or not isinstance(t_warmup, numbers.Integral) or t_warmup < 0:
        raise ValueError(f"Invalid t_warmup={t_warmup!r} (must be an integer >= 0)")

    cosine = CosineAnnealingLR(optimizer, T_max=t_max, eta_min=cosine_eta_min)
    if t_warmup == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=warmup_decay, total_iters=t_warmup)
    return SequentialLR(optimizer, schedulers=[warmup, cosine], milestones=[t_warmup])
