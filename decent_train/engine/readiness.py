"""When a bucket's gradients have all arrived during backward: one hook per bucket once the order is known.

A Python hook per parameter runs on autograd's thread for every tensor (161 for ResNet-50), and while it runs no
backward kernel is launched. So the first backward (and any after the order changed) counts arrivals per parameter
and learns which parameter of each bucket receives its gradient last; from then on only that parameter has a hook,
and when it fires the bucket checks that its other parameters' gradients arrived in this backward too (each gradient
is new, or was accumulated into since the training forward: its version moved). A bucket that fails the check
(its gradients came in another order, or some never came) is done at the end of backward, as the per-parameter
path does with unused parameters, and the next backward learns the order again; after ``RELEARN_LIMIT`` such
changes the parameters keep their own hooks (a graph whose order keeps changing).

Buckets update strictly in index order, so a gradient that arrives last in backward (a tied or reused weight used
early in forward, a branch unused on a step) holds back every later bucket to the end of backward. The completion
order (one entry per bucket, not per parameter) shows it at the end of backward: ``late_buckets`` counts those
buckets, and the first time it happens a warning names the parameter that held them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
        self._before: list[list[tuple[int, Tensor, int]]] = []  # bucket mode: the gradients there at the forward
        self._fired: set[int] = set()  # bucket mode: buckets whose hook fired in this backward
        self._reorder = False  # bucket mode: gradients came in another order in this backward
        self._completed: list[int] = []  # the buckets complete in this backward, in the order they completed
        self.late_buckets = 0  # buckets so far whose gradients came in backward but whose update waited for its end
        self._warned = False
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
        """At a training forward (bucket mode): note each gradient there is (position, tensor, version), so the check
        can tell a new one. A step sets the gradients to None, so there are usually none to note."""
        if not self.per_parameter:
            self._before = [[(i, g, g._version) for i, g in enumerate([p.grad for p in b.params]) if g is not None]
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
            if bucket.complete:
                self._completed.append(bucket.index)
            return bucket.complete
        if bucket.index in self._fired:
            raise RuntimeError(
                f"DecentralizedDataParallel: bucket {bucket.index}'s last gradient arrived twice in one backward "
                "(reentrant activation checkpointing?); use use_reentrant=False"
            )
        self._fired.add(bucket.index)
        if self._all_new(bucket):
            bucket.ready = len(bucket.params)
            self._completed.append(bucket.index)
        return bucket.complete

    def _stale(self, bucket: Bucket) -> Iterator[int]:
        """Bucket mode: the positions of ``bucket``'s parameters whose gradient is not new since the training forward
        (none yet, or the same tensor at the same version)."""
        before = {i: (grad, version) for i, grad, version in self._before[bucket.index]} if self._before else {}
        for i, p in enumerate(bucket.params):
            now = p.grad
            if now is None or (i in before and now is before[i][0] and now._version == before[i][1]):
                yield i

    def _all_new(self, bucket: Bucket) -> bool:
        """Whether every gradient of ``bucket`` is new: :meth:`_stale` finds none (on the hook's path, so in lists)."""
        grads = [p.grad for p in bucket.params]
        if True in [g is None for g in grads]:
            return False
        before = self._before[bucket.index] if self._before else ()
        return not any(grads[i] is grad and grad._version == version for i, grad, version in before)

    def _missing(self, bucket: Bucket) -> list[str]:
        """Names of ``bucket``'s parameters without a gradient from this backward so far (end of backward only)."""
        if self.per_parameter:
            return [n for n, p in zip(bucket.names, bucket.params) if id(p) not in self._arrived]
        return [bucket.names[i] for i in self._stale(bucket)]

    def end_of_backward(self, updates_in_backward: bool) -> None:
        """Backward has ended, before the buckets left are done (bucket mode): a bucket whose check failed but whose
        gradients have all come by now came in another order, so the next backward learns the order again. When buckets
        ``updates_in_backward`` (no deferred steps), those that waited for the end are counted (:meth:`_count_late`)."""
        if updates_in_backward:
            self._count_late()
        if not self.per_parameter:
            self._reorder = any(not b.complete and self._all_new(b) for b in self.buckets)

    def _count_late(self) -> None:
        """The buckets that waited for the end of backward although their own gradients came before it: those after
        the first bucket that completed last (the very end of backward) or not at all (done at the end). Those before
        it were released earlier; that bucket itself could not have gone earlier. A shorter wait in the middle of
        backward is not counted. Warns once, naming the parameter that came last (or not) in that first bucket."""
        position = {index: n for n, index in enumerate(self._completed)}
        last = len(self._completed) - 1
        blocker: Bucket | None = None
        late: list[int] = []
        for bucket in self.buckets:
            at = position.get(bucket.index)  # None: not complete in this backward
            if blocker is None:
                if at is None or at == last:
                    blocker = bucket
            elif at is not None and at < last:
                late.append(bucket.index)
        self.late_buckets += len(late)
        if not late or self._warned or blocker is None:
            return
        if position.get(blocker.index) is not None:
            param = self._last[blocker.index]
            names = [n for n, p in zip(blocker.names, blocker.params) if p is param]
            came = "got its gradient last in backward"
        else:
            names, came = self._missing(blocker), "got no gradient in this backward"
        if not names:  # bucket mode, gradients in another order: the next backward relearns and names it
            return
        self._warned = True
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        logger.warning(
            f"DecentralizedDataParallel: parameter '{names[0]}'{more} of bucket {blocker.index} {came}, so "
            f"{len(late)} later buckets (from {late[0]}), whose gradients had all come, stepped and launched only at "
            "the end of backward (lost overlap). A tied or reused weight, or a branch not used every step: register "
            "it first in the model so that it lands in the last bucket, or accept the loss."
        )

    def finish(self) -> None:
        """After every bucket's update: reset, and choose the hooks of the next backward."""
        for bucket in self.buckets:
            bucket.ready = 0
        self._arrived.clear()
        self._fired.clear()
        self._completed.clear()
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
