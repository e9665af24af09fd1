"""``algorithm=diloco`` and ``algorithm=localsgd``: the step-hook front of ``local_steps.py`` driven by the launcher.

Each worker trains the bare model with its own inner optimizer (``optim=``) and schedule (``scheduler=``); nothing
communicates in backward. Every ``algorithm.sync_every``-th inner step the front's hook (it runs inside
``inner.step()``) makes an outer step over ``topology=`` (``complete``: an all-reduce) with ``compression=`` applied to
what it sends. DiLoCo's outer optimizer is SGD with ``algorithm.outer_lr``, ``outer_momentum`` and ``nesterov``
(0.2 / 0.9 / Nesterov; torchtitan's lr is 0.7, see ``DiLoCoConfig``); LocalSGD averages the parameters instead.

Why the front and not a second implementation: the launcher and a user's own script then run the same update, which
``tests/test_local_steps.py`` checks against a float64 replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from decent_train.algorithms import local_steps
from decent_train.algorithms.base import Algorithm, register
from decent_train.algorithms.offload import check_offload
from decent_train.components.optim import make_optim_fn
from decent_train.config import AlgorithmConfig, AlgorithmTraits, TrainConfig
from decent_train.engine.optimizers import LRSchedulerFn
from decent_train.engine.schedule_resume import load_scheduler_state


@dataclass
class LocalSGDConfig(AlgorithmConfig):
    """``algorithm=localsgd``: H inner steps, then the parameters are mixed over the topology (averaged with
    ``complete``). ``fragments`` > 1 syncs the model in that many parts at staggered steps (Streaming DiLoCo), each
    ``fragment_sync_delay`` inner steps after its exchange started."""

    name: str = "localsgd"
    sync_every: int = 10  # inner steps per outer step (H)
    fragments: int = 1  # parts of the model synced at staggered steps (Streaming DiLoCo); 1: all at once
    # Inner steps between a fragment's exchange and its update. What those steps (and a script's own changes in
    # them) do to the fragment is replaced by the outer step's result (DiLoCo: unless fragment_update_alpha > 0
    # keeps a share of it): Streaming DiLoCo's design, docs/engine.md.
    fragment_sync_delay: int = 0
    # The outer state in pinned host memory between outer steps; null: when training on CUDA; false: on the device.
    # (The outer state: anchors, outer momentum, compressed public copies; the device holds the fragment in flight's
    # exchange buffers, and at its outer step a quarter of it at a time.)
    offload: Optional[bool] = None

    def __post_init__(self) -> None:
        self._check(fragment_update_alpha=0.0)

    def check_run(self, steps: int) -> None:
        """Every fragment syncs once per ``sync_every`` inner steps (fragment k after (k + 1) sync_every / fragments):
        a run shorter than that would never exchange the whole model (one fragment: nothing at all)."""
        if self.sync_every > steps:
            never = ("its first outer step: the workers would never communicate" if self.fragments == 1 else
                     f"each of its {self.fragments} fragments has synced once: part of the model would never be mixed")
            multiple = f" (a multiple of algorithm.fragments={self.fragments})" if self.fragments > 1 else ""
            raise ValueError(
                f"algorithm.sync_every={self.sync_every} with steps={steps}: the run would end before {never}; "
                f"valid: algorithm.sync_every <= {steps}{multiple}, or steps >= {self.sync_every}"
            )

    def _check(self, fragment_update_alpha: float) -> None:
        """The front's own rules (one place), their message naming the ``algorithm.`` key."""
        try:
            local_steps.check_local_steps_arguments(
                self.sync_every, self.fragments, self.fragment_sync_delay, fragment_update_alpha
            )
            check_offload(self.offload)
        except ValueError as error:
            raise ValueError(f"algorithm={self.name}: {error}") from None


@dataclass
class DiLoCoConfig(LocalSGDConfig):
    """``algorithm=diloco``: LocalSGD's options plus the outer optimizer (SGD over the pseudo-gradients) and
    ``fragment_update_alpha`` (a synced fragment keeps this share of its local parameters: torchft's mix)."""

    name: str = "diloco"
    # Not torchtitan's 0.7: Nesterov momentum 0.9 steps ~outer_lr / (1 - 0.9) times a steady pseudo-gradient, so 0.7
    # moves 7x as far as the inner steps did, too far for the default job's inner optimizer (measured in
    # docs/algorithms.md). Set 0.7 with a smaller inner lr (DiLoCo's long periods and large models).
    outer_lr: float = 0.2  # the outer optimizer's learning rate
    outer_momentum: float = 0.9  # the outer optimizer's momentum
    nesterov: bool = True  # Nesterov's momentum in the outer optimizer
    # A synced fragment keeps this share of its local parameters; 0 (torchft's default) drops the progress of the
    # fragment_sync_delay steps taken while its exchange ran (measured in docs/algorithms.md).
    fragment_update_alpha: float = 0.0

    def __post_init__(self) -> None:
        self._check(self.fragment_update_alpha)
        if self.outer_lr <= 0:
            raise ValueError(f"algorithm.outer_lr={self.outer_lr} must be > 0")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"algorithm.outer_momentum={self.outer_momentum} must be in [0, 1)")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("algorithm.nesterov=true needs algorithm.outer_momentum > 0 (or set nesterov=false)")


# A topology and compression apply; no phases, no fp16; sharded replicas and live membership changes run it.
_LOCAL_STEPS = dict(gossips=True, local_steps=True, shards=True, live=True)


class FrontAlgorithm(Algorithm):
    """What the algorithms over a front share (DiLoCo, LocalSGD, sharded gossip): the inner optimizer and schedule
    stepped by the loop, the front on its step hooks."""

    front: local_steps.DiLoCo

    def __init__(
        self, net: nn.Module, cfg: TrainConfig, schedule: LRSchedulerFn, scaler: torch.amp.GradScaler, steps_taken: int,
        from_rank0: bool = True,
    ) -> None:
        """``from_rank0=False``: a worker joining a running job (live membership), which loads a peer's state."""
        self.from_rank0 = from_rank0
        self.model = self.net = net  # no wrapper: nothing communicates in backward
        self.scaler, self.grad_clip_norm = scaler, cfg.grad_clip_norm
        self.inner = make_optim_fn(cfg.optim)(list(net.named_parameters()))
        self.schedule, self.scheduler = schedule, schedule(self.inner)
        self.options = cfg.algorithm
        self.consensus_every = cfg.logger.consensus_every
        self._topology_name = cfg.topology.name
        self.front = self._build_front(cfg, self._front_kwargs(cfg))
        self.front.__enter__()  # the hook stays on the inner optimizer for the whole run
        # The anchors are updated in place, so one probe (the parameters' coordinates, drawn once) serves the run.
        anchors = self.front.anchors()
        samples = cfg.logger.consensus_samples
        self.anchor_consensus = self.consensus_over(anchors, samples, cfg.seed) if anchors else None
        device = self.front.device
        if self.anchor_consensus is not None and anchors[0].device != device:
            self.anchor_consensus.device = device  # offloaded anchors in host memory: their samples go to the device

    def _build_front(self, cfg: TrainConfig, kwargs: dict[str, Any]) -> local_steps.DiLoCo:
        raise NotImplementedError

    def _front_kwargs(self, cfg: TrainConfig) -> dict[str, Any]:
        """The front's keywords every algorithm here shares: the exchange's compression and message size, the layout,
        the time limit."""
        compression = cfg.compression
        return {
            "compression": None if compression.name == "none" else compression.name,
            "consensus_step": compression.consensus_step,
            "int8_block": compression.int8_block,
            "local_world_size": cfg.topology.local_world_size,
            "timeout": cfg.comm_timeout_s,
            "offload": getattr(cfg.algorithm, "offload", None),
            "message_size_in_mb": cfg.message_size_mb,
            "fault_tolerant": cfg.fault_tolerance.live,
            "from_rank0": self.from_rank0,
        }

    @property
    def topology_name(self) -> str | None:
        return self._topology_name

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer, its schedule, the scaler and the front's state (counters, anchors, outer momentum):
        with the model's and the generators' (saved beside it) a resumed run continues bit-identically."""
        return {
            "inner": self.inner.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "front": self.front.state_dict(),
        }

    @staticmethod
    def averageable_state(state: dict[str, Any]) -> dict[str, Any]:
        """All but what one worker alone can use: the exchange in flight and the compressed public copies (the front
        restarts them from the averaged parameters). The floating-point tensors are averaged over the saved workers,
        the rest (counters, schedule, scaler) taken from rank 0's, equal on every worker. Why averaging the anchors
        and the outer momentum is right: the models are averaged too, and the pseudo-gradient (anchor − x) and SGD's
        momentum are linear in them, so the workers continue as from one outer step of ``complete`` (under which
        they are equal already); the inner optimizer's moments are averaged as the other algorithms average theirs.
        """
        return {**state, "front": {**state["front"], "in_flight": None, "in_flight_sent": None, "copies": None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        # After the optimizer's state: another schedule (steps=, warmup) sets the groups' LR to its own.
        load_scheduler_state(self.scheduler, state["scheduler"], self.schedule, {})
        self.scaler.load_state_dict(state["scaler"])
        self.front.load_state_dict(state["front"])

    def prepare_membership_change(self) -> None:
        self.front.prepare_membership_change()

    def membership_changed(self, topology: str, local_world_size: int) -> None:
        """The rule (docs/fault-tolerance.md, "Local steps under live membership"): the front's."""
        self.front.membership_changed(topology, local_world_size)
        self._topology_name = topology

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # backward never communicates

    def step(self) -> None:
        """One inner step (the front's outer step runs inside it, every ``sync_every``-th)."""
        if self.grad_clip_norm > 0:
            self.scaler.unscale_(self.inner)
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip_norm)
        self.scaler.step(self.inner)  # fp16 is refused for local steps (config): a plain inner.step()
        self.scaler.update()
        self.inner.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.inner]

    def bytes_per_step(self) -> float:
        """An outer step's bytes over ``sync_every`` (the front counts what its exchange sends)."""
        return float(self.front.bytes_per_inner_step())

    def comm_wait_seconds(self) -> float | None:
        return self.front.comm_wait_seconds  # blocked on the outer steps' exchanges

    def info(self) -> dict[str, Any]:
        topology = self.front.topology
        return {
            "topology/rounds": topology.describe(),
            "topology/period": topology.period,
            "topology/spectral_gap": topology.spectral_gap(),
            "local_steps/sync_every": self.options.sync_every,
            "local_steps/fragments": self.options.fragments,
            "local_steps/offload": self.front.offloaded,
        }

    def metrics(self) -> dict[str, Any]:
        """``outer/step``; the bytes of the front's outer state on the parameters' device and, offloaded, in host
        memory (``DiLoCo.memory_bytes``: this rank's, now); at the consensus steps (``logger.consensus_every``, as
        ``consensus/distance``) the workers' distance at the anchors, their parameters at the last outer step
        (DiLoCo only: LocalSGD keeps none)."""
        held = self.front.memory_bytes()
        values: dict[str, Any] = {"outer/step": self.front.outer_steps,
                                  "memory/outer_device_mib": held["device"] / 2**20,
                                  "memory/outer_host_mib": held["host"] / 2**20}
        every, step = self.consensus_every, self.front.inner_steps
        if self.anchor_consensus is not None and every > 0 and step % every == 0:
            self.front.host_state_ready()  # offloaded: the last outer step's anchors have arrived in host memory
            values["consensus/anchor_distance"], values["consensus/anchor_relative"] = self.anchor_consensus.measure()
        return values

    def _shared_state(self) -> list[Tensor]:
        """What evaluation averages: the parameters and the floating-point buffers (BatchNorm's statistics)."""
        buffers = [b for b in self.net.buffers() if b.is_floating_point()]
        return [p.data for p in self.net.parameters()] + buffers

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        tensors = self._shared_state()
        saved = [t.clone() for t in tensors]
        self.front.members.average_tensors_(tensors, "the evaluation's average of the models")
        try:
            yield
        finally:
            torch._foreach_copy_(tensors, saved)

    def average(self) -> None:
        self.front.members.average_tensors_(self._shared_state(), "the final average of the models")


@register("diloco", traits=AlgorithmTraits(schema=DiLoCoConfig, **_LOCAL_STEPS))
class DiLoCoAlgorithm(FrontAlgorithm):
    """DiLoCo: the outer optimizer (Nesterov SGD) steps from the mixed anchors with the mixed pseudo-gradients."""

    def _build_front(self, cfg: TrainConfig, kwargs: dict[str, Any]) -> local_steps.DiLoCo:
        options = cfg.algorithm
        assert isinstance(options, DiLoCoConfig)
        kwargs |= {"fragments": options.fragments, "fragment_sync_delay": options.fragment_sync_delay}
        trainable = [p for p in self.net.parameters() if p.requires_grad]
        self.outer = torch.optim.SGD(
            trainable, lr=options.outer_lr, momentum=options.outer_momentum, nesterov=options.nesterov
        )
        return local_steps.DiLoCo(self.net, self.inner, self.outer, options.sync_every, cfg.topology.name,
                                  fragment_update_alpha=options.fragment_update_alpha, **kwargs)


@register("localsgd", traits=AlgorithmTraits(schema=LocalSGDConfig, **_LOCAL_STEPS))
class LocalSGDAlgorithm(FrontAlgorithm):
    """LocalSGD: the parameters are mixed over the topology every ``sync_every`` inner steps."""

    def _build_front(self, cfg: TrainConfig, kwargs: dict[str, Any]) -> local_steps.DiLoCo:
        options = cfg.algorithm
        assert isinstance(options, LocalSGDConfig)
        kwargs |= {"fragments": options.fragments, "fragment_sync_delay": options.fragment_sync_delay}
        return local_steps.LocalSGD(self.net, self.inner, options.sync_every, cfg.topology.name, **kwargs)

