"""A bucket's fused Adam/AdamW step through torch's functional ``adam`` (engine/fused_step.py) is torch's own
``step()`` to the bit, and declines wherever ``step()`` would do something else.

Oracle: the same optimizer class stepped by torch's ``step(); zero_grad()`` on a copy of the parameters, with two
param groups (weight decay on one), an LR scheduler changing the rate every step, a parameter without a gradient
on one step, and the state replaced by ``load_state_dict`` midway. In the engine: at world size 1 every bucket's
fused AdamW step must equal one fused AdamW over the whole model (the kernel is elementwise, so how parameters
group into calls does not change a bit), and the engine must have taken the fast path; alone, it steps every
bucket with one call per set of hyperparameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.optim import Adam, AdamW, Optimizer

from decent_train import DecentralizedDataParallel
from decent_train.engine import fused_step
from decent_train.engine.fused_step import step_and_zero_grad
from decent_train.engine.optimizers import param_groups_with_weight_decay
from tests.distributed import run_workers

STEPS = 8


def _params(device: str = "cpu") -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in [(4, 3), (3,), (5, 2), (2,)]]


def _optimizer(cls: type[Optimizer], params: list[nn.Parameter], **kwargs: Any) -> Optimizer:
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    return cls(groups, **{"lr": 0.05, "fused": True, **kwargs})


CASES = [(AdamW, {}), (Adam, {"amsgrad": True}), (AdamW, {"maximize": True, "betas": (0.8, 0.95)}),
         (AdamW, {"lr": torch.tensor(0.05)})]


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=["adamw", "adam-amsgrad", "adamw-maximize", "adamw-tensor-lr"])
def test_step_and_zero_grad_equals_torchs_step(cls: type[Optimizer], kwargs: dict[str, Any], device: str = "cpu") -> None:
    ours, theirs = _params(device), _params(device)
    ours_opt, theirs_opt = _optimizer(cls, ours, **kwargs), _optimizer(cls, theirs, **copy.deepcopy(kwargs))
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (ours_opt, theirs_opt)]
    g = torch.Generator().manual_seed(1)
    fast = []
    for step in range(STEPS):
        if step == 5:  # state replaced: what a resume does; the fast path reads the new tensors
            saved = copy.deepcopy(theirs_opt.state_dict())
            ours_opt.load_state_dict(saved)
            theirs_opt.load_state_dict(copy.deepcopy(saved))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            grad = torch.randn(a.shape, generator=g).to(device)
            a.grad, b.grad = (None, None) if (step == 3 and i == 1) else (grad.clone(), grad.clone())
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)
        done = step_and_zero_grad(ours_opt)
        if not done:
            ours_opt.step()
            ours_opt.zero_grad(set_to_none=True)
        fast.append(done)
        for scheduler in schedulers:
            scheduler.step()
        assert all(p.grad is None for p in ours)
    assert fast == [False] + [True] * (STEPS - 1)  # the first step makes the state through step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for a, b in zip(ours, theirs):
        for key, value in theirs_opt.state[b].items():
            assert torch.equal(ours_opt.state[a][key], value), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on one)")
@pytest.mark.parametrize(("cls", "kwargs"), CASES[:2], ids=["adamw", "adam-amsgrad"])
def test_step_and_zero_grad_equals_torchs_step_on_cuda(cls: type[Optimizer], kwargs: dict[str, Any]) -> None:
    test_step_and_zero_grad_equals_torchs_step(cls, kwargs, device="cuda")


class _AdamWSubclass(AdamW):
    pass


DECLINED: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {
    "a step pre-hook": lambda ps: _with(_optimizer(AdamW, ps), lambda o: o.register_step_pre_hook(lambda *a: None)),
    "a step post-hook": lambda ps: _with(_optimizer(AdamW, ps), lambda o: o.register_step_post_hook(lambda *a: None)),
    "a subclass": lambda ps: _optimizer(_AdamWSubclass, ps),
    "not fused": lambda ps: AdamW(ps, lr=0.05, foreach=True),
    "step patched on the instance": lambda ps: _with(_optimizer(AdamW, ps), _patch_step),
    "torch's SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
}


def _with(opt: Optimizer, change: Callable[[Optimizer], Any]) -> Optimizer:
    change(opt)
    return opt


def _patch_step(opt: Optimizer) -> None:
    step = opt.step
    opt.step = lambda *a, **k: step(*a, **k)  # type: ignore[method-assign]


@pytest.mark.parametrize("why", list(DECLINED))
def test_declines_and_changes_nothing_where_step_would_differ(why: str) -> None:
    params = _params()
    opt = DECLINED[why](params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the state exists: only ``why`` stands in the fast path's way
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    assert not step_and_zero_grad(opt)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(p.grad is not None for p in params)


def _fused_adamw(named: list[tuple[str, Tensor]]) -> Optimizer:
    return AdamW(param_groups_with_weight_decay(named, 0.1), lr=0.01, fused=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _engine_run(rank: int, world_size: int) -> tuple[dict[str, Tensor], list[int], int]:
    """The parameters after STEPS steps, the functional ``adam()`` calls of each step, the buckets."""
    calls: list[int] = []
    functional = fused_step.adam

    def counted(*args: Any, **kwargs: Any) -> None:
        calls[-1] += 1
        functional(*args, **kwargs)

    fused_step.adam = counted  # type: ignore[assignment]
    try:
        engine = DecentralizedDataParallel(_model(), _fused_adamw, topology="ring", bucket_size_in_mb=0.0003)
        assert len(engine.optimizers) > 1
        for step in range(STEPS):
            calls.append(0)
            x, y = _batch(step)
            ((engine(x) - y) ** 2).mean().backward()
    finally:
        fused_step.adam = functional  # type: ignore[assignment]
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, calls, len(engine.optimizers)


def test_engine_buckets_step_through_it_and_equal_one_fused_adamw() -> None:
    model = _model()
    opt = _fused_adamw(list(model.named_parameters()))
    for step in range(STEPS):
        x, y = _batch(step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params, calls, _ = run_workers(_engine_run, 1)[0]
    assert sum(calls) > 0  # the buckets took the fast path (after their first step)
    for name, value in model.state_dict().items():
        assert torch.equal(params[name], value), name


def test_a_worker_alone_steps_its_buckets_in_one_call_per_hyperparameter_set() -> None:
    """Issue 37's invariant for a worker alone: the optimizer calls per step do not grow with the buckets. It exchanges
    nothing, so its buckets step at the end of backward, one ``adam()`` per set of hyperparameters (weight decay and
    none: 2) over every bucket; the first step makes the state through ``step()`` (no call here). Stepping each
    bucket on its own, as with peers, makes a call per bucket and group (counted before: more than 2)."""
    _, calls, buckets = run_workers(_engine_run, 1)[0]
    assert buckets > 2
    assert calls == [0] + [2] * (STEPS - 1)
