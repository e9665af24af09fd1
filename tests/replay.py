"""The oracle: a single-process float64 replay of decentralized SGD, and the matching multi-process engine run.

Replay of n workers, optimizer step s = 0, 1, ...:
    g_i   = grad f_i(x_i^s; batch(i, s))          # at the un-mixed local parameters
    x_i  <- sum_j W(s)_ij x_j^s                     # W(s): the topology's round s mod period, as a dense matrix
    x_i  <- optimizer_i.step(g_i)                   # the local update
It knows nothing of buckets, hooks, process groups or exchanges.

Schedules: from a phase's first step its rounds count from 0; an all-reduce phase first replaces every worker's
parameters and optimizer state tensors by their means, then each step averages the workers' gradients and mixes
nothing. With
``global_avg_every=k`` the parameters are replaced by their mean after every gossip step s with (s + 1) % k == 0.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from decent_train import DecentralizedDataParallel, Topology, build_topology, optim_fn_sgd

SEED = 1000
SGD = partial(optim_fn_sgd, lr=0.05, momentum=0.9, weight_decay=1e-3)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def batch(rank: int, step: int, micro: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10007 * rank + 101 * step + micro)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)


def loss_fn(model: nn.Module, rank: int, step: int, micro: int = 0) -> Tensor:
    x, y = batch(rank, step, micro)
    return ((model(x) - y) ** 2).mean()


def replay(
    topology: Topology,
    steps: int,
    optim_fn: Callable = SGD,
    lr_scheduler_fn: Callable | None = None,
    model_fn: Callable[[int], nn.Module] = make_model,
    loss: Callable[[nn.Module, int, int, int], Tensor] = loss_fn,
    micro_batches: int = 1,
    grad_clip_norm: float = 0.0,
    adaptive_factor: float = 1.0,
    average_before_step: int | None = None,
    phases: dict[int, Topology | None] | None = None,
    global_avg_every: int = 0,
) -> list[dict[str, Tensor]]:
    """Each worker's parameters after ``steps`` optimizer steps.

    ``average_before_step=k`` replaces every worker's parameters by the global average just before step k's forward
    (what ``global_avg(will_revert=False)`` does). ``phases`` maps a step to the topology used from it on (None:
    all-reduce).
    """
    n = topology.world_size
    models = [copy.deepcopy(model_fn(SEED)) for _ in range(n)]  # rank 0's init
    optimizers = [optim_fn(list(m.named_parameters())) for m in models]
    schedulers = [lr_scheduler_fn(o) if lr_scheduler_fn else None for o in optimizers]
    names = [name for name, _ in models[0].named_parameters()]

    def params(name: str) -> list[Tensor]:
        return [dict(m.named_parameters())[name] for m in models]

    @torch.no_grad()
    def average() -> None:
        for name in names:
            mean = torch.stack(params(name)).mean(0)
            for p in params(name):
                p.copy_(mean)

    @torch.no_grad()
    def average_optimizer_states() -> None:
        for name in names:
            states = [o.state[p] for o, p in zip(optimizers, params(name))]
            for key, value in states[0].items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    mean = torch.stack([state[key] for state in states]).mean(0)
                    for state in states:
                        state[key].copy_(mean)

    current, start = topology, 0
    for s in range(steps):
        if phases and s in phases:
            current, start = phases[s], s
            if current is None:
                average()
                average_optimizer_states()
        if s == average_before_step:
            average()
        for i, m in enumerate(models):
            m.zero_grad(set_to_none=True)
            for micro in range(micro_batches):
                loss(m, i, s, micro).backward()
        if current is None:  # all-reduce: every worker steps on the mean gradient
            for name in names:
                mean = torch.stack([p.grad for p in params(name)]).mean(0)
                for p in params(name):
                    p.grad = mean.clone()
        for m in models:
            if grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(m.parameters(), grad_clip_norm)
        if current is not None:
            w = current.mixing_matrix(s - start)
            mixed = w * adaptive_factor + torch.eye(n, dtype=torch.float64) * (1 - adaptive_factor)
            with torch.no_grad():
                for name in names:
                    stacked = torch.stack(params(name))
                    new = torch.einsum("ij,j...->i...", mixed.to(stacked.dtype), stacked)
                    for i, p in enumerate(params(name)):
                        p.copy_(new[i])
        for o, sch in zip(optimizers, schedulers):
            o.step()
            if sch is not None:
                sch.step()
        if global_avg_every and (s + 1) % global_avg_every == 0 and current is not None:
            average()
    return [snapshot(m) for m in models]


def single_process(model: nn.Module, iterations: int, loss: Callable, clip: float = 0.0) -> dict[str, Tensor]:
    """Plain one-process SGD: the oracle when every worker sees the same batches (all workers then stay equal)."""
    model = copy.deepcopy(model)
    optimizer = SGD(list(model.named_parameters()))
    for it in range(iterations):
        optimizer.zero_grad(set_to_none=True)
        loss(model, it).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return snapshot(model)


def train_engine(
    rank: int,
    world_size: int,
    topology: str,
    steps: int,
    optim_fn: Callable = SGD,
    lr_scheduler_fn: Callable | None = None,
    model_fn: Callable[[int], nn.Module] = make_model,
    loss: Callable[[nn.Module, int, int, int], Tensor] = loss_fn,
    micro_batches: int = 1,
    average_before_step: int | None = None,
    adaptive_factor: float = 1.0,
    phases: dict[int, str] | None = None,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """One worker's training run through the engine; the same inputs as :func:`replay` (``phases`` by name, with
    "allreduce")."""
    model = model_fn(SEED + rank)  # a different init on every rank: the engine must start all from rank 0's
    engine_kwargs.setdefault("bucket_size_in_mb", 0.0005)  # several buckets for this small model
    ddp = DecentralizedDataParallel(model, optim_fn, lr_scheduler_fn, topology=topology, **engine_kwargs)
    ddp.set_adaptive_factor(adaptive_factor)
    for s in range(steps):
        if phases and s in phases:
            ddp.switch_to(phases[s])
        if s == average_before_step:
            ddp.global_avg(will_revert=False)
        for micro in range(micro_batches):
            ddp.set_accumulate_grad(micro < micro_batches - 1)
            loss(ddp, rank, s, micro).backward()
    return {
        "params": snapshot(ddp),
        "buckets": ddp.bucket_names,
        "step": ddp.step_count,
    }


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    """A copy of the parameters and buffers (BatchNorm statistics) by (bare) name."""
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def max_deviation(engine: list[dict[str, Any]], expected: list[dict[str, Tensor]]) -> float:
    return max(
        (result["params"][name] - want[name]).abs().max().item()
        for result, want in zip(engine, expected)
        for name in want
    )


def topology_for(name: str, world_size: int, local_world_size: int = 1) -> Topology:
    return build_topology(name, world_size, local_world_size)


def round_trip(compressor: Any, values: Tensor) -> Tensor:
    """D(Q(values)): what a receiver decodes from the message of ``values`` (a 1-D tensor)."""
    scratch = values.new_zeros(compressor.padded_numel(values.numel()))
    scratch[: values.numel()] = values
    compressor.encode_(scratch, torch.empty(compressor.message_bytes(values.numel()), dtype=torch.uint8))
    return scratch[: values.numel()].clone()


def replay_compressed(
    topology: Topology,
    steps: int,
    compressor: Any,
    buckets: list[list[str]],
    optim_fn: Callable = SGD,
    consensus_step: float = 1.0,
    model_fn: Callable[[int], nn.Module] = make_model,
    loss: Callable[[nn.Module, int, int, int], Tensor] = loss_fn,
    align: int = 32,
    pair_copy_dtype: torch.dtype | None = None,
) -> list[dict[str, Tensor]]:
    """Each worker's parameters after ``steps`` steps of compressed gossip (CHOCO with public copies per round).

    Worker i keeps, for every round r in which it has a group, its public copy c_i^r, starting from the common initial
    parameters; its group's members know it exactly. At step s >= 1 of round r = s mod period, on each bucket's flat
    vector (parameters in ``buckets`` order, each padded with zeros to a multiple of ``align`` elements, as the
    compressor sees them):
        q_i = D(Q(x_i - c_i^r));  c_i^r += q_i (stored in ``pair_copy_dtype`` in rounds where i has one peer)
        x_i += consensus_step * (sum_{j != i} W_ij c_j^r - (1 - W_ii) c_i^r)
    then every worker steps its optimizer on the gradient taken before the mix. (At step 0 the exchange would carry
    zero differences: the workers start equal.)
    """
    n, period = topology.world_size, topology.period
    models = [copy.deepcopy(model_fn(SEED)) for _ in range(n)]
    optimizers = [optim_fn(list(m.named_parameters())) for m in models]
    matrices = [topology.mixing_matrix(r) for r in range(period)]

    def flat(i: int, names: list[str]) -> Tensor:
        parameters = dict(models[i].named_parameters())
        parts = []
        for name in names:
            value = parameters[name].detach().reshape(-1)
            parts += [value, value.new_zeros(-(-value.numel() // align) * align - value.numel())]
        return torch.cat(parts)

    @torch.no_grad()
    def write(i: int, names: list[str], vector: Tensor) -> None:
        parameters, offset = dict(models[i].named_parameters()), 0
        for name in names:
            p = parameters[name]
            p.copy_(vector[offset : offset + p.numel()].view_as(p))
            offset += -(-p.numel() // align) * align

    members = lambda r, i: [j for j in range(n) if matrices[r][i, j] > 0]  # noqa: E731
    stored = lambda r, i, v: v.to(pair_copy_dtype) if pair_copy_dtype and len(members(r, i)) == 2 else v  # noqa: E731
    copies = {
        (i, r, b): stored(r, i, flat(i, names))
        for i in range(n) for r in range(period) for b, names in enumerate(buckets) if len(members(r, i)) > 1
    }
    for s in range(steps):
        for i, m in enumerate(models):
            m.zero_grad(set_to_none=True)
            loss(m, i, s, 0).backward()
        if s >= 1:
            r, w = s % period, matrices[s % period].double()
            for b, names in enumerate(buckets):
                xs = [flat(i, names) for i in range(n)]
                grouped = [i for i in range(n) if len(members(r, i)) > 1]
                for i in grouped:
                    held = copies[i, r, b].to(xs[i].dtype)
                    copies[i, r, b] = stored(r, i, held + round_trip(compressor, xs[i] - held))
                for i in grouped:
                    c = {j: copies[j, r, b].to(xs[i].dtype) for j in members(r, i)}
                    others = sum(float(w[i, j]) * c[j] for j in members(r, i) if j != i)
                    write(i, names, xs[i] + consensus_step * (others - (1 - float(w[i, i])) * c[i]))
        for o in optimizers:
            o.step()
    return [snapshot(m) for m in models]
