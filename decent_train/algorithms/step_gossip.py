"""Per-step gossip over the user's own optimizer, on whole or FSDP2-sharded models: ``with Gossip(model, optimizer,
topology="ring", mesh=mesh):`` around a loop that calls ``optimizer.step()``.

What step s computes (worker or replica i; W the topology's round s − 1 mod period: the exchange started after step
s − 1, numbered by the exchanges before it; the engine numbers the same round s, which matters only when rounds
differ)::

    x_i <- x_i + Σ_j W_ij x_j^s − x_i^s   (the optimizer's step pre-hook: the exchange of x^s, in flight since the
                                          last step, applied as a correction to the parameters now)
    x_i <- optimizer step at that x with the gradient computed at x^s      (the user's optimizer)
    start the exchange of x^{s+1}       (the step post-hook: it runs during the next forward and backward)

Without edits between two steps x_i = x_i^s and the first line is x_i <- Σ_j W_ij x_j: the engine's update
(``x^{s+1} = W x^s − U(∇f(x^s))``, decent-dp's), with the optimizer stepping whole after backward instead of per
bucket inside it. Why a correction, not x <- W x^s: a script may change the parameters after ``optimizer.step()``
(a clamp, a pruning mask, a max-norm projection, ``load_state_dict``), after x^s was sent; replacing x by the mix
would undo that change on every worker, even alone (audit D1). So the change survives, and one worker (W = [1]) or
workers holding equal parameters compute exactly what the script computes without the front. Compressed (CHOCO),
the mix is x^s + γ Σ_j W_ij (x̂_j − x̂_i), so the correction is γ Σ_j W_ij (x̂_j − x̂_i): either way it sums to zero over
the workers (W symmetric), and the mean moves by the optimizer's steps and the script's changes alone. What this
costs: x^s is read back from the payload buffer where the round leaves it unwritten (a pair's swap, a worker alone),
else from a copy made as the exchange starts (one payload more: ``complete``'s in-place all-reduce, rounds of several
stages, compression).

Why a front rather than the engine for sharded models: FSDP2 owns the parameters' storage (each rank holds a DTensor
shard; the whole parameter exists only between its all-gather and its free), so the engine's flat buckets of
parameters and its hooks in backward cannot hold them. The exchange here works on the local shards between two
optimizer steps, when FSDP2 is not using them, and never gathers a parameter. With ``mesh`` (2-D: replicate, shard),
the topology runs over the replicas and each rank swaps its shard with the same shard of the replicas its replica
mixes with (``ShardedTopology``): every message is 1/shard of the model. Compression applies to those messages
(CHOCO's public copies per shard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from decent_train.algorithms.local_steps import LocalSGD
from decent_train.algorithms.outer_exchange import ParameterRun
from decent_train.engine.membership import TopologySpec

__all__ = ["Gossip"]


class Gossip(LocalSGD):
    """``with Gossip(model, optimizer, topology="ring"):``: every ``optimizer.step()`` mixes the parameters over one
    round of ``topology`` first (see the module). Keywords as ``LocalSGD``'s (``compression``, ``consensus_step``,
    ``int8_block``, ``local_world_size``, ``timeout``, ``mesh``); all workers start from rank 0's parameters (sharded:
    replica 0's)."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, topology: TopologySpec = "ring", **kwargs: Any):
        scheduled = [k for k in ("sync_every", "fragments", "fragment_sync_delay", "fragment_update_alpha")
                     if k in kwargs]
        if scheduled:  # (else "got multiple values for argument 'sync_every'", or a message about sync_every=1)
            raise TypeError(f"Gossip mixes at every optimizer step, whole: {scheduled[0]}={kwargs[scheduled[0]]!r} "
                            "does not apply (LocalSGD and DiLoCo take it)")
        super().__init__(model, optimizer, 1, topology, **kwargs)
        self._pre_handle: Any = None
        for group in self.groups:
            group.keep_sent = True  # the outer step's correction reads x^s back (see the module)

    def __enter__(self) -> Gossip:
        self._pre_handle = self.inner.register_step_pre_hook(self._before_step)
        self._handle = self.inner.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pre_handle is not None:
            self._pre_handle.remove()
            self._pre_handle = None
        super().__exit__(*exc)

    def _exchange_due(self) -> bool:
        """An exchange is in flight between any two steps (after the first): the one mixed at the next step."""
        return self.inner_steps > 0

    @torch.no_grad()
    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._in_flight is not None:
            self.outer_step()  # finish the exchange of x^s and mix: x <- W x^s

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        self._in_flight = self.exchange.start(self._next_fragment())

    def _apply(self, part: list[ParameterRun]) -> None:
        """x <- x + (W x^s − x^s) (see the module); the mixed values become the correction in their own buffer, which
        nothing reads again before the next exchange refills it. From a checkpoint without what was sent (an older
        one): x <- W x^s, as before the correction."""
        for run in part:
            if not run.sent:
                torch._foreach_copy_(run.params, run.first)
                continue
            torch._foreach_sub_(run.first, run.sent)
            torch._foreach_add_(run.params, run.first)
