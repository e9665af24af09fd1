"""A bucket's fused Adam/AdamW step, without the Python that ``Optimizer.step()`` wraps around torch's functional
``adam``.

The engine steps one optimizer per bucket inside backward, where a plain loop steps one per model. Where the host is
the bottleneck (ResNet-50 at batch 64 on an H200, scripts/BENCHMARKS.md), what each ``step()`` and ``zero_grad()``
adds around the kernel (profiler ranges, hooks, grad mode, the graph-capture check, ``_init_group``) is paid once per
bucket and shows in step time. This calls the same functional ``torch.optim.adam.adam`` with the arguments
``Adam.step`` passes, read from the optimizer's own groups and state, so the update is the same to the bit; it
declines, changing nothing, wherever ``step()`` could do something else (hooks, a patched ``step``, state not yet
made, a scaler's attributes), and the caller runs ``step()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Adam, AdamW, Optimizer
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam

__all__ = ["step_and_zero_grad", "step_and_zero_grad_many"]

_ADAMS = (Adam, AdamW)
_HYPERPARAMETERS = ("lr", "betas", "weight_decay", "eps", "maximize", "amsgrad", "foreach", "decoupled_weight_decay")


def _plain_fused_adam(opt: Optimizer) -> bool:
    """Exactly torch's Adam or AdamW (a subclass may override ``step``) with every group fused, no hooks, and
    ``step`` not patched on the instance (an LR scheduler's wrapper, which only records the call, excepted)."""
    if type(opt) not in _ADAMS:
        return False
    patched = opt.__dict__.get("step")
    if patched is not None and not (getattr(patched, "_wrapped_by_lr_sched", False)
                                    and getattr(patched, "__wrapped__", None) is type(opt).step):
        return False
    if (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks
            or torch_optimizer._global_optimizer_post_hooks or hasattr(opt, "grad_scale") or hasattr(opt, "found_inf")):
        return False
    return all(g["fused"] and not g["differentiable"] and not g["capturable"] for g in opt.param_groups)


def step_and_zero_grad(opt: Optimizer) -> bool:
    """``opt.step(); opt.zero_grad(set_to_none=True)`` through ``adam()`` directly: True if done, False (nothing
    changed) where the caller must call them itself."""
    return not step_and_zero_grad_many([opt])


def step_and_zero_grad_many(opts: list[Optimizer]) -> list[Optimizer]:
    """``step(); zero_grad(set_to_none=True)`` of each of ``opts`` (over distinct parameters) that this can take,
    with one ``adam()`` call per set of hyperparameters over all of them: a worker alone steps its buckets at the end
    of backward (engine/steps.py), where one kernel launch does for every bucket. Returns the optimizers it declined,
    unchanged, in order: the caller steps those itself."""
    merged: dict[tuple[Any, ...], tuple[dict[str, Any], list[list[Tensor]]]] = {}
    declined, stepped = [], []
    for opt in opts:
        gathered = _gathered(opt)
        if gathered is None:
            declined.append(opt)
            continue
        stepped.append(opt)
        for group, lists in gathered:
            key = tuple(id(v) if isinstance(v, Tensor) else v for v in (group[k] for k in _HYPERPARAMETERS))
            if key in merged:
                for into, more in zip(merged[key][1], lists):
                    into += more
            else:
                merged[key] = (group, lists)
    with torch.no_grad():
        for group, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) in merged.values():
            beta1, beta2 = group["betas"]
            adam(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=False, differentiable=False, fused=True,
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
    for opt in stepped:
        opt._opt_called = True  # what an LR scheduler's wrapper of step() sets (its order check reads it)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
    return declined


def _gathered(opt: Optimizer) -> list[tuple[dict[str, Any], list[list[Tensor]]]] | None:
    """Per group with a gradient: the group and the lists ``adam()`` takes (parameters, gradients, the two moments,
    the max of the second (amsgrad), step counts); None where ``step()`` must run instead."""
    if not _plain_fused_adam(opt):
        return None
    gathered = []
    for group in opt.param_groups:
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        amsgrad = group["amsgrad"]
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            state = opt.state.get(p)
            if not state or grad.is_sparse or p.is_complex():  # step() makes the state, or raises
                return None
            params.append(p)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        if params:
            gathered.append((group, [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps]))
    return gathered
