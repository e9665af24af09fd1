"""Local steps over the user's own optimizer: DiLoCo and LocalSGD, with an all-reduce (``complete``) or gossip outer
step over any topology.

Why here and in this shape: torchft's LocalSGD and DiLoCo are context managers over the inner optimizer's step hooks,
so any script that calls ``optimizer.step()`` adopts them with two lines; they all-reduce the outer step. Replacing W
= J/n by a topology's round removes the last global collective. What the outer step computes (worker i, outer step
k = 0, 1, ..., after every ``sync_every``-th ``inner.step()``; W the topology's round k mod period)::

    Δ_i = anchor_i − x_i                 (pseudo-gradient: torchft's sign)
    a_i = Σ_j W_ij anchor_j              (the mixed anchor)
    g_i = Σ_j W_ij Δ_j = a_i − Σ_j W_ij x_j
    x_i <- outer step from a_i with gradient g_i;  anchor_i <- x_i

With ``complete`` (W = J/n) that is DiLoCo exactly; LocalSGD is x_i <- Σ_j W_ij x_j. All workers start from rank 0's
parameters and buffers. DiLoCo's exchange sends [x, anchor] in one message per dtype (twice the model, once every
``sync_every`` steps) because under gossip the anchors differ between workers (LocalSGD sends x alone); it runs
when the outer step is due (exact; overlapping it with the next inner steps is the streaming variant, not built
yet).
design notes: torchft_local_sgd.md (what torchft does), tests/test_local_steps.py (the float64 replay).
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from decent_train.engine.comm import CommWaits, peers_must_answer
from decent_train.engine.exchange import ExchangeBuffers, Exchanger
from decent_train.engine.membership import Membership, TopologySpec

__all__ = ["DiLoCo", "LocalSGD"]


class _Group:
    """The parameters of one dtype and device: their anchors (DiLoCo's) and the exchange buffer [x] or [x, anchor]."""

    def __init__(self, index: int, params: list[nn.Parameter], anchored: bool):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        first = params[0]
        self.flat = torch.zeros((2 if anchored else 1) * self.numel, dtype=first.dtype, device=first.device)
        self.buffers = ExchangeBuffers(index=index, flat=self.flat, comm=torch.zeros_like(self.flat))
        self.anchors = [p.detach().clone() for p in params] if anchored else []


class DiLoCo:
    """``with DiLoCo(model, inner, outer, sync_every=H, topology="complete"):`` around a training loop that calls
    ``inner.step()``. ``outer`` must be built over the model's parameters (torchft's convention)."""

    anchored = True  # keeps anchors and exchanges them with the parameters (LocalSGD needs neither)

    def __init__(
        self,
        model: nn.Module,
        inner: Optimizer,
        outer: Optimizer | None,
        sync_every: int,
        topology: TopologySpec = "complete",
        *,
        local_world_size: int | None = None,
        timeout: float | None = None,
    ):
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r}: must be a positive integer (inner steps per outer step)")
        if outer is None and type(self) is DiLoCo:
            raise ValueError("DiLoCo needs an outer optimizer over the model's parameters (LocalSGD has none)")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DiLoCo: the model has no trainable parameters")
        if outer is not None:
            owned = {id(p) for group in outer.param_groups for p in group["params"]}
            missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
            if missing:
                raise ValueError(
                    f"the outer optimizer must be built over the model's parameters; it lacks {missing[0]}"
                )
        self.model, self.inner, self.outer, self.sync_every = model, inner, outer, sync_every
        self.members = Membership(local_world_size, timedelta(seconds=timeout) if timeout is not None else None)
        state = list(model.named_parameters()) + list(model.named_buffers())
        self.members.check_same_model(state)
        self.members.broadcast_from_rank0([t.data for _, t in state])  # all start from rank 0's
        self.topology = self.members.topology(topology)
        by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        self.groups = [_Group(i, ps, self.anchored) for i, ps in enumerate(by_kind.values())]
        device = next((g.flat.device for g in self.groups if g.flat.device.type == "cuda"), torch.device("cpu"))
        self.members.create_exchange_group(device)
        self.exchanger = Exchanger(self.members.rank, self.members.exchange_group, 0, 1.0)
        self.waits = CommWaits(self.members.timeout)
        self.inner_steps = 0
        self.outer_steps = 0
        self._handle: Any = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the model's and the inner optimizer's: the counters, the anchors and the
        outer optimizer's state (momentum). Resume: build the front, then load the model, the inner optimizer and
        this (building broadcasts rank 0's parameters; loading afterwards restores each worker's own)."""
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "anchors": [[a.clone() for a in group.anchors] for group in self.groups],
            "outer": self.outer.state_dict() if self.outer is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = [[tuple(a.shape) for a in anchors] for anchors in state["anchors"]]
        mine = [[tuple(a.shape) for a in group.anchors] for group in self.groups]
        if saved != mine:
            raise ValueError(f"the saved anchors have shapes {saved}, this model's parameters {mine}")
        for group, anchors in zip(self.groups, state["anchors"]):
            torch._foreach_copy_(group.anchors, anchors)
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])

    def __enter__(self) -> DiLoCo:
        self._handle = self.inner.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_inner_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """The outer step of round ``outer_steps mod period`` (see the module)."""
        for group in self.groups:
            xs, anchors = _views(group, group.flat)
            torch._foreach_copy_(xs, [p.detach() for p in group.params])
            if anchors:
                torch._foreach_copy_(anchors, group.anchors)
            self._apply(group, *_views(group, self._mix(group)))
        if self.outer is not None:
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        for group in self.groups:
            if group.anchors:
                torch._foreach_copy_(group.anchors, [p.detach() for p in group.params])
        self.outer_steps += 1

    def _apply(self, group: _Group, mixed_xs: list[Tensor], mixed_anchors: list[Tensor]) -> None:
        """x <- a (the outer optimizer then steps from there) with gradient g = a − W x."""
        for p, a, wx in zip(group.params, mixed_anchors, mixed_xs):
            p.grad = a - wx
            p.copy_(a)

    def _mix(self, group: _Group) -> Tensor:
        """W [x, anchor] (LocalSGD: W x) for this worker's group(s) of the round, the stages of a round one after the
        other."""
        value, rank, round_ = group.flat, self.members.rank, self.outer_steps
        for edge in self.topology.edges(round_, rank):
            works = self.exchanger.start(group.buffers, edge, value)
            if works:
                with peers_must_answer(f"the outer step {round_}'s exchange with ranks {edge.ranks}",
                                       self.members.timeout):
                    self.waits.wait(works, value.device)
            value = self.exchanger.finish(group.buffers, edge, value)
        return value


class LocalSGD(DiLoCo):
    """``with LocalSGD(model, optimizer, sync_every=H, topology=...):``: every H-th ``optimizer.step()``, the
    parameters become Σ_j W_ij x_j (DiLoCo with an outer SGD of learning rate 1, applied exactly; no anchors, so an
    outer step sends the model once)."""

    anchored = False

    def __init__(self, model: nn.Module, optimizer: Optimizer, sync_every: int, topology: TopologySpec = "complete",
                 **kwargs: Any):
        super().__init__(model, optimizer, None, sync_every, topology, **kwargs)

    def _apply(self, group: _Group, mixed_xs: list[Tensor], mixed_anchors: list[Tensor]) -> None:
        torch._foreach_copy_([p.detach() for p in group.params], mixed_xs)


def _views(group: _Group, flat: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """``flat``'s x part and anchor part (empty without anchors), as views shaped like the parameters."""
    xs, anchors, offset = [], [], 0
    for p in group.params:
        xs.append(flat[offset : offset + p.numel()].view_as(p))
        if group.anchors:
            anchors.append(flat[group.numel + offset : group.numel + offset + p.numel()].view_as(p))
        offset += p.numel()
    return xs, anchors
