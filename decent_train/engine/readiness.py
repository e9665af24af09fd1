"""When a bucket's gradients have all arrived during backward: one hook per bucket once the order is known.

A Python hook per parameter runs on autograd's thread for every tensor (161 for ResNet-50), and while it runs no
backward kernel is launched. So the first backward (and any after the order changed) counts arrivals per parameter
and learns which parameter of each bucket receives its gradient last; from then on only that parameter has a hook,
and when it fires the bucket checks that its other parameters' gradients arrived in this backward too (each gradient
is new, or was accumulated into since the training forward: its version moved). A bucket that fails the check
(its gradients came in another order, or some never came) is done at the end of backward, as the per-parameter
path does with unused parameters, and the next backward learns the order again; after ``RELEARN_LIMIT`` such
changes the parameters keep their own hooks (a graph whose order keeps changing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loguru import logger
from torch import Tensor, nn

from decent_train.engine.buckets import Bucket

__all__ = ["GradientReadiness", "RELEARN_LIMIT"]

RELEARN_LIMIT = 3


class GradientReadiness:
    """The gradient hooks of the engine's buckets. ``on_gradient(bucket, param)`` is called from each hook (``param``
    is the parameter whose gradient arrived); it asks :meth:`arrived` whether the bucket is complete now. A compiled
    ``model`` is ``announce``d: its gradients all arrive when its one backward node ends."""

    def __init__(self, buckets: list[Bucket], on_gradient: Callable[[Bucket, nn.Parameter], None], model: nn.Module,
                 announce: bool = True):
        self.buckets, self.on_gradient = buckets, on_gradient
        if announce and any(getattr(m, "_compiled_call_impl", None) for m in model.modules()):
            logger.info("DecentralizedDataParallel: the model is compiled, so its backward is one autograd node and "
                        "every bucket steps when it ends: the exchange overlaps the next forward, not backward")
        self.per_parameter = True  # hooks on every parameter (learning the order) or on one per bucket
        self.relearned = 0
        self.hooks_fired = 0  # hooks called in backward passes so far (the invariant the tests pin)
        self._handles: list[Any] = []
        self._last: list[nn.Parameter | None] = [None] * len(buckets)  # per bucket: the parameter heard last
        self._arrived: set[int] = set()  # per-parameter mode: ids of the parameters whose gradient came
        self._before: list[list[tuple[Tensor | None, int]]] = []  # bucket mode: each gradient at the forward
        self._fired: set[int] = set()  # bucket mode: buckets whose hook fired in this backward
        self._reorder = False  # bucket mode: gradients came in another order in this backward
        self._install()

    def _install(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for bucket in self.buckets:
            watched = bucket.params if self.per_parameter else [self._last[bucket.index]]
            for param in watched:
                if param is not None:
                    self._handles.append(param.register_post_accumulate_grad_hook(
                        lambda p, b=bucket: self._fire(b, p)))

    def _fire(self, bucket: Bucket, param: nn.Parameter) -> None:
        self.hooks_fired += 1
        self.on_gradient(bucket, param)

    def start_step(self) -> None:
        """At a training forward (bucket mode): note each gradient as it is, so the check can tell a new one."""
        if not self.per_parameter:
            self._before = [[(p.grad, p.grad._version if p.grad is not None else 0) for p in b.params]
                            for b in self.buckets]

    def arrived(self, bucket: Bucket, param: nn.Parameter) -> bool:
        """``param``'s gradient arrived: whether ``bucket`` has all of its gradients now."""
        if self.per_parameter:
            if id(param) in self._arrived:
                name = bucket.names[bucket.params.index(param)]
                raise RuntimeError(
                    f"DecentralizedDataParallel: parameter '{name}' received its gradient twice in one backward "
                    "(reentrant activation checkpointing?); use use_reentrant=False"
                )
            self._arrived.add(id(param))
            self._last[bucket.index] = param
            bucket.ready += 1
            return bucket.complete
        if bucket.index in self._fired:
            raise RuntimeError(
                f"DecentralizedDataParallel: bucket {bucket.index}'s last gradient arrived twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._fired.add(bucket.index)
        if self._all_new(bucket):
            bucket.ready = len(bucket.params)
        return bucket.complete

    def _all_new(self, bucket: Bucket) -> bool:
        before = self._before[bucket.index] if self._before else [(None, 0)] * len(bucket.params)
        for p, (grad, version) in zip(bucket.params, before):
            now = p.grad
            if now is None or (now is grad and now._version == version):
                return False
        return True

    def end_of_backward(self) -> None:
        """Backward has ended, before the buckets left are done (bucket mode): a bucket whose check failed but whose
        gradients have all come by now came in another order, so the next backward learns the order again."""
        if not self.per_parameter:
            self._reorder = any(not b.complete and self._all_new(b) for b in self.buckets)

    def finish(self) -> None:
        """After every bucket's update: reset, and choose the hooks of the next backward."""
        for bucket in self.buckets:
            bucket.ready = 0
        self._arrived.clear()
        self._fired.clear()
        self._before = []
        reorder, self._reorder = self._reorder, False
        if self.per_parameter and self.relearned <= RELEARN_LIMIT:
            self.per_parameter = False  # the order is learned: one hook per bucket from now on
            self._install()
        elif reorder:
            self.relearned += 1
            self.per_parameter = True
            if self.relearned > RELEARN_LIMIT:
                logger.info(f"DecentralizedDataParallel: the order of gradients changed {self.relearned} times; "
                            "every parameter keeps its own gradient hook from now on")
            self._install()
