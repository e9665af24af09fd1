"""Local steps over the user's own optimizer: DiLoCo and LocalSGD, with an all-reduce (``complete``) or gossip outer
step over any topology, optionally streamed in fragments and compressed.

Why here and in this shape: torchft's LocalSGD and DiLoCo are context managers over the inner optimizer's step hooks,
so any script that calls ``optimizer.step()`` adopts them with two lines; they all-reduce the outer step. Replacing W
= J/n by a topology's round removes the last global collective. What an outer step computes (worker i, a fragment's
outer step k = 0, 1, ...; W the topology's round k mod period; x the fragment's parameters when its exchange
starts)::

    Δ_i = anchor_i − x_i                 (pseudo-gradient: torchft's sign)
    a_i = Σ_j W_ij anchor_j              (the mixed anchor)
    g_i = Σ_j W_ij Δ_j = a_i − Σ_j W_ij x_j
    global_i = the outer optimizer's step from a_i with gradient g_i;  anchor_i <- global_i
    x_i <- (1 − α) global_i + α local_i  (α = fragment_update_alpha, local_i the parameters when it finishes)

With ``complete`` (W = J/n) that is DiLoCo exactly; LocalSGD is global_i = Σ_j W_ij x_j (SGD of rate 1). All workers
start from rank 0's parameters and buffers; the inner optimizer's state is each worker's own throughout.

The schedule is torchft's Streaming DiLoCo: the trainable parameters are cut into F ``fragments``, synced in turn, one
every P = sync_every / F inner steps (so each every ``sync_every``; fragment 0 first after P). A fragment's exchange
starts after inner step P − τ of its period (τ = ``fragment_sync_delay``) and is finished, and the outer step taken,
after step P: the τ inner steps between overlap with the communication. τ = 0 is exact. Unlike torchft with one outer
optimizer, the optimizer steps only the synced fragment's parameters (the others' gradients are hidden from it), as
torchft's one-optimizer-per-fragment form does. What travels and how compression keeps the mean: outer_exchange.py.
design notes: docs/design/torchft-local-sgd.md (what torchft does), tests/test_local_steps.py (the float64 replay).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from decent_train.algorithms.offload import (
    HostStore, OuterStateHome, check_offload, held_bytes_by_place, resolve_offload,
)
from decent_train.algorithms.outer_exchange import (
    Fragment, InFlight, OuterExchange, OuterGroup, ParameterRun, one_uniform_group, payload_kind, replicas,
    split_parameters,
)
from decent_train.engine.compress import Compressor, check_consensus_step, make_compressor
from decent_train.engine.ddp import check_engine_arguments
from decent_train.engine.membership import Membership, TopologySpec, local_part
from decent_train.engine.topology import Edge

if TYPE_CHECKING:  # FSDP2's modules cost 0.6 s to import: only runs that shard import them
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DiLoCo", "LocalSGD", "check_local_steps_arguments"]

OUTER_STEP_PARTS = 4  # offload: an outer step brings the optimizer's state in this many parts of its fragment


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _whole(value) or isinstance(value, float)


def _shown(value: Any) -> str:
    """``value``'s repr where it is one short line, else its type (an optimizer's repr is a dozen lines)."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= 60 else f"<{type(value).__name__}>"


def check_local_steps_arguments(sync_every: Any, fragments: Any, fragment_sync_delay: Any,
                                fragment_update_alpha: Any) -> None:
    """One line naming the bad value and what is valid (the launcher's config runs the same checks)."""
    if not _whole(sync_every) or sync_every < 1:
        raise ValueError(f"sync_every={_shown(sync_every)}: must be a positive integer (inner steps per outer step)")
    if not _whole(fragments) or fragments < 1:
        raise ValueError(f"fragments={fragments!r}: must be a positive integer (parts of the model synced in turn)")
    if sync_every % fragments:
        raise ValueError(f"sync_every={sync_every} is not a multiple of fragments={fragments}: one fragment syncs "
                         "every sync_every / fragments inner steps")
    period = sync_every // fragments
    if not _whole(fragment_sync_delay) or not 0 <= fragment_sync_delay < period:
        raise ValueError(f"fragment_sync_delay={fragment_sync_delay!r}: must be an integer in [0, {period}) "
                         f"(sync_every / fragments = {period} inner steps between syncs)")
    if not _number(fragment_update_alpha) or not 0.0 <= fragment_update_alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha={_shown(fragment_update_alpha)}: must be in [0, 1], a number "
                         "(the weight of the local parameters against the outer step's result)")


def check_front_arguments(model: Any, inner: Any, outer: Any, fragments: Any, compression: Any,
                          local_world_size: Any, timeout: Any, mesh: Any) -> None:
    """The fronts' other arguments, each refused in one line naming it, its value and what is valid (audit D6), not
    a TypeError deep in the construction, or nothing (``timeout=0`` fails every exchange at once, ``local_world_size=0``
    was read as unset, an outer optimizer that is the inner one steps the parameters twice)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={_shown(model)}: must be a torch.nn.Module")
    for what, value in (("inner", inner), ("outer", outer)):
        if (value is not None or what == "inner") and not isinstance(value, Optimizer):
            raise TypeError(f"{what}={_shown(value)}: must be a torch.optim.Optimizer over the model's parameters")
    if outer is inner:
        raise ValueError("outer is the inner optimizer: DiLoCo's outer optimizer is a second one over the model's "
                         "parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)")
    if isinstance(fragments, list) and not fragments:
        raise ValueError("fragments=[]: a list of modules needs one at least (or give a number of fragments >= 1)")
    if not _whole(fragments) and not isinstance(fragments, list):
        raise TypeError(f"fragments={_shown(fragments)}: must be a positive integer or a list of modules")
    codec = ("padded_numel", "message_bytes", "encode_", "decode")
    if compression is not None and not isinstance(compression, str) and not all(hasattr(compression, a) for a in codec):
        raise TypeError(f"compression={_shown(compression)}: valid are None, 'none', 'bf16', 'int8' or a compressor "
                        "object (engine/compress.py, Compressor)")
    if local_world_size is not None and (not _whole(local_world_size) or local_world_size < 1):
        raise ValueError(f"local_world_size={_shown(local_world_size)}: must be a positive integer (workers per "
                         "node) or None (the LOCAL_WORLD_SIZE torchrun sets)")
    if timeout is not None and (not _number(timeout) or timeout <= 0):
        raise ValueError(f"timeout={_shown(timeout)}: must be a number of seconds > 0, or None (no limit)")
    if mesh is not None and not all(hasattr(mesh, a) for a in ("ndim", "mesh", "get_group")):
        raise TypeError(f"mesh={_shown(mesh)}: must be a 2-D DeviceMesh (replicate, shard) or None")


def _named(thing: Any) -> str | None:
    """A setting's name to compare between ranks: a string itself, else its ``name`` or class."""
    name = thing if thing is None or isinstance(thing, str) else getattr(thing, "name", None)
    return name if isinstance(name, str) or thing is None else getattr(thing, "__name__", type(thing).__name__)


def replicas_of(mesh: DeviceMesh | None) -> tuple[int, Any]:
    """(ranks per replica, this rank's replicate group) of a 2-D mesh (replicate, shard) that FSDP2 shards a model
    over with ``fully_shard(..., mesh=mesh["shard"])``; (1, None) without a mesh. Its replicas must be consecutive
    ranks (``init_device_mesh(device, (replicas, shard))``'s layout), as the topologies count them."""
    if mesh is None:
        return 1, None
    if mesh.ndim != 2:
        raise ValueError(f"mesh: a 2-D mesh (replicate, shard) is needed; got {mesh.ndim} dimensions")
    replicas, shard = mesh.mesh.shape
    if not torch.equal(mesh.mesh.flatten().cpu(), torch.arange(replicas * shard)):
        raise ValueError(f"mesh: replicas must be consecutive ranks (init_device_mesh(device, ({replicas}, {shard}))); "
                         f"got {mesh.mesh.tolist()}")
    return int(shard), mesh.get_group(0) if replicas > 1 else None


class DiLoCo:
    """``with DiLoCo(model, inner, outer, sync_every=H, topology="complete"):`` around a training loop that calls
    ``inner.step()``. ``outer`` must be built over the model's parameters (torchft's convention). ``fragments``: a
    number, or the modules whose parameters form each fragment (torchft's ``model_fragments``); ``compression``:
    ``"int8"``, ``"bf16"`` or a compressor, applied to what an outer step sends.

    ``offload``: keep the anchors, the outer optimizer's state and the compressed public copies in (pinned) host
    memory, and device buffers only for what the fragment whose exchange is in flight sends and receives
    (offload.py): uncompressed over ``complete``, one fragment's payload instead of 3x the model (to ~13x for int8
    over a ring); its outer step brings the outer optimizer's state in ``OUTER_STEP_PARTS`` parts, an
    ``outer.step()`` each. ``None`` (the default): on when the parameters are on CUDA and an outer step comes less
    often than every inner step (per-step gossip would move its whole state every step); ``False`` keeps everything
    on the device, as small models may; ``True`` forces it (on the CPU the same code path copies host to host). The
    result is the same either way (tests/test_local_steps_offload.py). :meth:`memory_bytes` says what the front holds
    where."""

    anchored = True  # keeps anchors and steps an outer optimizer (LocalSGD does neither)

    def __init__(
        self,
        model: nn.Module,
        inner: Optimizer,
        outer: Optimizer | None,
        sync_every: int,
        topology: TopologySpec = "complete",
        *,
        fragments: int | list[nn.Module] = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        compression: str | Compressor | None = None,
        consensus_step: float = 1.0,
        int8_block: int = 256,
        local_world_size: int | None = None,
        timeout: float | None = None,
        mesh: DeviceMesh | None = None,
        offload: bool | None = None,
        message_size_in_mb: float = 0.0,
        fault_tolerant: bool = False,
        from_rank0: bool = True,
    ):
        check_front_arguments(model, inner, outer, fragments, compression, local_world_size, timeout, mesh)
        count = fragments if isinstance(fragments, int) else len(fragments)
        check_engine_arguments(message_size_in_mb=message_size_in_mb)
        check_local_steps_arguments(sync_every, count, fragment_sync_delay, fragment_update_alpha)
        check_consensus_step(consensus_step)
        check_offload(offload)
        compressor = make_compressor(compression, int8_block)
        named = self._trainable(model, inner, outer)
        self._synced = {id(p) for _, p in named}
        self._stepped = self._unsynced_in_inner(inner)
        shard, replicate_group = replicas_of(mesh)
        parts = split_parameters(named, fragments)
        self.model, self.inner, self.outer, self.sync_every = model, inner, outer, sync_every
        self.period, self.delay, self.alpha = sync_every // count, fragment_sync_delay, fragment_update_alpha
        self.members = Membership(local_world_size, timedelta(seconds=timeout) if timeout is not None else None,
                                  point_to_point=fault_tolerant, shard=shard, replicate_group=replicate_group)
        if from_rank0:  # a joiner (live membership) builds alone and loads its donor's state
            state = [(n, local_part(t)) for n, t in [*model.named_parameters(), *model.named_buffers()]]
            self.members.check_same_model(state, {
                "algorithm": type(self).__name__, "sync_every": sync_every, "fragments": count,
                "fragment_sync_delay": fragment_sync_delay, "fragment_update_alpha": fragment_update_alpha,
                "topology": _named(topology), "compression": _named(compressor),
                "int8_block": int8_block if compressor is not None else None, "consensus_step": consensus_step,
                "message_size_in_mb": message_size_in_mb, "fault_tolerant": fault_tolerant, "outer": _named(outer)})
            self.members.broadcast_from_rank0([t.detach() for _, t in state])  # rank 0's (sharded: replica 0's)
        device = next((p.device for _, p in named if p.device.type == "cuda"), torch.device("cpu"))
        self.members.create_exchange_group(device)
        self.topology = self.members.topology(topology)
        # Live membership sends x+anchor on every topology: a missed message is replaced by the receiver's own
        # payload, which keeps W' x and W' anchor a row of one matrix (``delta`` assumes equal anchors), and the
        # payload stays one size whatever topology the members change to.
        payload = payload_kind(self.anchored, self.topology, compressor is not None or fault_tolerant)
        self.device = device
        self.offloaded = resolve_offload(offload, device) and (offload is not None or sync_every > 1)
        store = HostStore(device) if self.offloaded else None
        self.store = store
        # one all-reduce of all workers (a worker alone is one too), not a pair's swap: reduced in its own buffer
        in_place = not fault_tolerant and replicas(self.topology) != 2 and one_uniform_group(self.topology)
        self.fragments: list[Fragment] = []
        names = {id(p): name for name, p in named}
        for params in parts:
            by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
            for p in params:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            first = sum(len(f.groups) for f in self.fragments)  # exchange buffers are numbered across fragments
            groups = [OuterGroup(first + i, ps, payload, names=[names[id(p)] for p in ps], store=store,
                                 reduce_in_place=in_place)
                      for i, ps in enumerate(by_kind.values())]
            self.fragments.append(Fragment(groups))
        if compressor is not None:
            for group in self.groups:
                group.compress(compressor, self._my_groups())
        message_bytes = max(1, int(message_size_in_mb * 2**20)) if message_size_in_mb else 0
        self.exchange = OuterExchange(self.members, self.topology, consensus_step, message_bytes, fault_tolerant)
        self.exchange.check_messages(self.groups, message_size_in_mb)
        self.outer_home = OuterStateHome(store, outer) if store is not None and outer is not None else None
        self.inner_steps = 0
        self.outer_steps = 0  # outer steps taken, of all fragments
        self._in_flight: InFlight | None = None
        self._handle: Any = None

    def _trainable(self, model: nn.Module, inner: Optimizer, outer: Optimizer | None) -> list[tuple[str, Tensor]]:
        """The model's trainable parameters, by name, which the inner optimizer must hold some of (it steps them) and
        DiLoCo's outer optimizer all of (it applies their pseudo-gradients)."""
        if outer is None and self.anchored:
            raise ValueError("DiLoCo needs an outer optimizer over the model's parameters (LocalSGD has none)")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(self).__name__}: the model has no trainable parameters")
        stepped = {id(p) for group in inner.param_groups for p in group["params"]}
        if not any(id(p) in stepped for _, p in named):
            raise ValueError(f"the inner optimizer holds none of the model's trainable parameters (such as "
                             f"{named[0][0]}): build it over model.parameters()")
        if outer is not None:
            owned = {id(p) for group in outer.param_groups for p in group["params"]}
            if missing := [name for name, p in named if id(p) not in owned]:
                raise ValueError(f"the outer optimizer must be built over the model's parameters; it lacks "
                                 f"{missing[0]}")
        return named

    def _unsynced_in_inner(self, inner: Optimizer) -> tuple[int, list[Tensor]]:
        """(the inner optimizer's parameter count, those of its parameters the front does not sync)."""
        held = [p for group in inner.param_groups for p in group["params"]]
        return len(held), [p for p in held if id(p) not in self._synced]

    def _check_trainable_set(self) -> None:
        """The trainable set is fixed when the front is built (fragments, anchors, buffers, outer state): a model
        parameter made trainable in the inner optimizer since (``add_param_group``, ``requires_grad_``) is refused at
        the next outer step, not left to drift apart between workers (audit D4). Cheap: a count and a look."""
        count, unsynced = self._stepped
        if count == sum(len(g["params"]) for g in self.inner.param_groups) and not any(
                p.requires_grad for p in unsynced):
            return
        self._stepped = count, unsynced = self._unsynced_in_inner(self.inner)
        names = {id(p): name for name, p in self.model.named_parameters()}
        if added := [names[id(p)] for p in unsynced if p.requires_grad and id(p) in names]:
            raise RuntimeError(f"parameter '{added[0]}' became trainable in the inner optimizer after the "
                               f"{type(self).__name__} front was built, which syncs only the parameters trainable "
                               "then: unfreeze before building the front, or build a new one after")

    def _my_groups(self) -> list[Edge]:
        """This worker's groups of two or more over the topology's period (each keeps its compressed copies)."""
        return [e for r in range(self.topology.period) for e in self.topology.edges(r) if e.size > 1]

    @property
    def groups(self) -> list[OuterGroup]:
        return [g for f in self.fragments for g in f.groups]

    def anchors(self) -> list[Tensor]:
        """The anchors of the trainable parameters (of their local shards), in ``model.parameters()`` order (LocalSGD
        keeps none: []); offloaded: the host copies, which every outer step updates in place (call
        :meth:`host_state_ready` before reading them later)."""
        self.host_state_ready()
        by_param = {id(p): a for g in self.groups for p, a in zip(g.owners, g.anchors)}
        return [by_param[id(p)] for p in self.model.parameters() if id(p) in by_param]

    def host_state_ready(self) -> None:
        """Offload: the host waits for the copies out in flight (before it reads host memory: a checkpoint, the
        anchors' consensus). Nothing otherwise."""
        if self.store is not None:
            self.store.wait()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the tensors this front holds now, by place: ``"device"`` (the parameters' device) and ``"host"``
        (offloaded); each storage once: every fragment's anchors, exchange buffers (payload, receive buffer, a
        point-to-point group's rows, Gossip's copy of what it sent), compressed scratch, messages and public copies,
        and the outer optimizer's state of the front's parameters. On CUDA a tensor counts where it is; with the
        parameters on the CPU (one memory) by its container: the offload's host copies as host, all else as device."""
        held = [item for group in self.groups for item in group.held()]
        if self.outer is not None:
            held += [(local_part(v), self._at_home(p, v)) for group in self.groups for p in group.owners
                     for v in self.outer.state.get(p, {}).values() if isinstance(v, Tensor)]
        if self.outer_home is not None:
            held += self.outer_home.held()
        return held_bytes_by_place(held, self.device.type == "cuda")

    def _at_home(self, param: Tensor, value: Tensor) -> bool:
        home = self.outer_home.home.get(param, {}) if self.outer_home is not None else {}
        return any(value is h for h in home.values())

    def bytes_per_inner_step(self) -> float:
        """Bytes this worker sends per inner step: every fragment's outer step once per ``sync_every`` inner steps,
        averaged over the topology's period."""
        return self.exchange.bytes_per_sync(self.fragments) / self.sync_every

    @property
    def comm_wait_seconds(self) -> float:
        """Seconds blocked on the outer exchanges so far."""
        return self.exchange.waits.seconds

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the model's and the inner optimizer's: the counters, the anchors, the outer
        optimizer's state, compressed public copies, and an exchange in flight (waited for: its mixed result). Resume:
        build the front, then load the model, the inner optimizer and this. Every worker calls it at the same step."""
        in_flight = self._in_flight
        mixed = None if in_flight is None else [m.clone() for m in self.exchange.finish(in_flight)]
        sent = None if in_flight is None or in_flight.sent is None else [
            [t.clone() for t in group] for group in in_flight.sent]  # Gossip: x^s, its outer step's correction's
        self.host_state_ready()
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "fragment_syncs": [f.syncs for f in self.fragments],
            "anchors": [[a.clone() for a in group.anchors] for group in self.groups],
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "copies": [g.copies_state() for g in self.groups],
            "in_flight": mixed,
            "in_flight_sent": sent,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``; without its ``copies`` and ``in_flight`` (an average of several workers'
        states: parameters and anchors equal everywhere) the copies restart from the payload and an exchange due to
        be in flight starts from the parameters now."""
        for group in self.groups:
            group.discard()  # offload: an exchange in flight is dropped (as without); the host state is overwritten
        self.host_state_ready()
        if state["anchors"] is not None:  # None: loaded already (a sharded model's, from its DCP checkpoint)
            saved = [[tuple(a.shape) for a in anchors] for anchors in state["anchors"]]
            mine = [[tuple(a.shape) for a in group.anchors] for group in self.groups]
            if saved != mine:
                raise ValueError(f"the saved anchors have shapes {saved}, this model's parameters {mine}")
            for group, anchors in zip(self.groups, state["anchors"]):
                if anchors:  # LocalSGD keeps none
                    torch._foreach_copy_(group.anchors, anchors)
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])  # torch puts the state on the parameters' device
        if self.outer_home is not None:  # (a sharded model's comes from DCP, loaded before)
            self.outer_home.send_home([p for g in self.groups for p in g.owners])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        for fragment, syncs in zip(self.fragments, state.get("fragment_syncs", [self.outer_steps])):
            fragment.syncs = int(syncs)
        copies = state.get("copies") or [None] * len(self.groups)
        for group, saved_copies in zip(self.groups, copies):
            if saved_copies is not None and group.buffers.compressed is not None:
                group.load_copies(saved_copies)
            else:
                group.reset_copies()
        self._in_flight = None
        if self._exchange_due():
            fragment = self._next_fragment()
            mixed, sent = state.get("in_flight"), state.get("in_flight_sent")
            self._in_flight = (self._start(fragment) if mixed is None
                               else InFlight(fragment, fragment.syncs, [], [], mixed=[m.clone() for m in mixed],
                                             sent=None if sent is None else [[t.clone() for t in g] for g in sent]))

    def prepare_membership_change(self) -> None:
        """Live membership, between inner steps: nothing may be in flight (``fragment_sync_delay`` = 0, which the
        config requires under live: each fragment's exchange starts and ends inside its own outer step)."""
        if self._in_flight is not None:
            raise RuntimeError("a membership change with an outer exchange in flight (fragment_sync_delay > 0)")

    @torch.no_grad()
    def membership_changed(self, topology: TopologySpec, local_world_size: int | None = None) -> None:
        """Live membership, after the default group was reconfigured (every member, a healed joiner too): the
        outer steps go on over ``topology`` built over the new members (point to point: no process groups to
        rebuild; rounds still counted by each fragment's ``syncs``, equal on every member), and the anchors and the
        outer optimizer's state become their mean over the members (docs/fault-tolerance.md, "Local steps under
        live membership": equal already after complete outer steps that missed nothing, equal again otherwise).
        Compressed, every member's public copies then restart at the same value (``OuterGroup.restart_copies``)."""
        self.members.refresh(local_world_size)
        self.topology = self.members.topology(topology)
        self.exchange.changed(self.topology)
        shared = [a for g in self.groups for a in g.anchors]
        if self.outer is not None:
            shared += [v for g in self.groups for p in g.owners for v in self.outer.state.get(p, {}).values()
                       if isinstance(v, Tensor) and v.is_floating_point() and v.dim() > 0]
        if shared:
            self._average_over_members(shared)
        for group in self.groups:  # after the mean: the copies restart from the anchors, equal on every member
            group.restart_copies(self._my_groups())

    def _average_over_members(self, tensors: list[Tensor]) -> None:
        """``tensors`` <- their mean over the members. Offloaded (host tensors), the mean runs on the parameters'
        device, where the data group's collectives run (NCCL takes no host tensors), a part of about
        1 / ``OUTER_STEP_PARTS`` of the largest fragment's bytes at a time, as the outer step's state comes in."""
        what = "the anchors' and outer state's average at a membership change"
        store = self.store
        if store is None:
            self.members.average_tensors_(tensors, what)
            return
        budget = -(-max(sum(p.nbytes for g in f.groups for p in g.params) for f in self.fragments) // OUTER_STEP_PARTS)
        parts: list[list[Tensor]] = [[]]
        size = 0
        for tensor in tensors:
            if parts[-1] and size + tensor.nbytes > budget:
                parts.append([])
                size = 0
            parts[-1].append(tensor)
            size += tensor.nbytes
        for part in parts:
            working = store.to_device(part)
            self.members.average_tensors_(working, what)
            store.copy_out(part, working)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Optimizer steps that are not training steps (torch.distributed.checkpoint's state template steps the
        optimizer once with lr 0) neither count nor exchange."""
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()

    def __enter__(self) -> DiLoCo:
        self._handle = self.inner.register_step_post_hook(self._after_inner_step)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if kind is None and self._in_flight is not None:
            self.exchange.finish(self._in_flight)  # nothing left in flight when the process group goes
        self.exchange.linger(self.fragments)  # what gloo's thread may still hold outlives this front

    def _local_step(self) -> int:
        """Inner steps into the current fragment's period, 1..P (0 before the first)."""
        return (self.inner_steps - 1) % self.period + 1 if self.inner_steps else 0

    def _exchange_due(self) -> bool:
        """Whether an exchange is in flight after ``inner_steps``: started, its outer step not yet taken."""
        return self.delay > 0 and self.period - self.delay <= self._local_step() < self.period

    def _next_fragment(self) -> Fragment:
        return self.fragments[self.outer_steps % len(self.fragments)]

    def _after_inner_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        local = self._local_step()
        if local == self.period - self.delay:
            self._in_flight = self._start(self._next_fragment())
        if local == self.period:
            self.outer_step()

    def _start(self, fragment: Fragment) -> InFlight:
        """Start ``fragment``'s exchange (offload: its device buffers made now, and only its)."""
        if self.store is not None:  # one fragment in flight at a time: its exchange starts P − τ > 0 steps after the
            # previous one's outer step (τ < P), and ends at its own outer step
            assert not any(g.acquired for g in self.groups), "another fragment's exchange is still in flight"
        return self.exchange.start(fragment)

    @torch.no_grad()
    def outer_step(self) -> None:
        """Finish the exchange in flight (started now if none is) and take the fragment's outer step, a part of the
        fragment at a time (:meth:`_parts`)."""
        self._check_trainable_set()
        exchange = self._in_flight or self._start(self._next_fragment())
        self._in_flight = None
        fragment = exchange.fragment
        for group in fragment.groups:
            group.follow_params()  # (the model's storage may have moved since the exchange started)
        mixed = self.exchange.finish(exchange)
        for part in self._parts(fragment, mixed, exchange.sent):
            params = [p for run in part for p in run.params]
            local = [p.clone() for p in params] if self.alpha else None
            self._apply(part)
            if local is not None:
                torch._foreach_lerp_(params, local, self.alpha)
        for group in fragment.groups:
            group.release()  # offload: the public copies back to host memory, the buffers dropped
        fragment.syncs += 1
        self.outer_steps += 1

    def _parts(self, fragment: Fragment, mixed: list[Tensor],
               sent: list[list[Tensor]] | None = None) -> list[list[ParameterRun]]:
        """The fragment's parameters in the parts its outer step takes in turn: all at once; offload: parts of about
        1 / ``OUTER_STEP_PARTS`` of the fragment's bytes (at least one tensor each), so that the outer optimizer's
        state and the step's temporaries on the device are that part's, not the fragment's. Per-parameter optimizers
        (torch's) give the same result either way; each part is one ``outer.step()`` call."""
        budget = sum(p.nbytes for g in fragment.groups for p in g.params)
        if self.store is not None:
            budget = -(-budget // OUTER_STEP_PARTS)
        parts: list[list[ParameterRun]] = [[]]
        size = 0
        for k, (group, value) in enumerate(zip(fragment.groups, mixed)):
            first, second = group.views(value)
            was = sent[k] if sent is not None else []
            start = 0
            for i, param in enumerate(group.params):
                if size and size + param.nbytes > budget:
                    if i > start:
                        parts[-1].append(ParameterRun(group, slice(start, i), first[start:i], second[start:i],
                                                      was[start:i]))
                    parts.append([])
                    size, start = 0, i
                size += param.nbytes
            parts[-1].append(ParameterRun(group, slice(start, None), first[start:], second[start:], was[start:]))
        return parts

    def _apply(self, part: list[ParameterRun]) -> None:
        """x <- a with gradient g = a − W x (``delta``: the mixed Δ and the own anchor, equal on every worker), the
        outer optimizer's step over these parameters alone, anchor <- x."""
        gradients, owners = [], []
        for run in part:
            if run.group.payload == "delta":
                run.group.anchors_into(run.params, run.which)
                gradients += run.first
            else:
                torch._foreach_copy_(run.params, run.second)
                torch._foreach_sub_(run.second, run.first)  # W anchor − W x, in place
                gradients += run.second
            owners += run.owners
        self._outer_step_over(owners, gradients)
        for run in part:
            run.group.anchors_from(run.params, run.which)

    def _outer_step_over(self, owners: list[nn.Parameter], gradients: list[Tensor]) -> None:
        """``outer.step()`` with ``gradients`` on ``owners`` and no gradient on the other parameters (skipped by
        torch's optimizers: their momentum stays); every parameter's own ``.grad`` is back afterwards. Offload: the
        optimizer's state of ``owners`` comes to the device for the step and goes back."""
        assert self.outer is not None
        everything = [p for group in self.outer.param_groups for p in group["params"]]
        kept = [p.grad for p in everything]
        for p in everything:
            p.grad = None
        for p, g in zip(owners, gradients):
            p.grad = _gradient_for(p, g)
        if self.outer_home is not None:
            self.outer_home.bring_in(owners)
        self.outer.step()
        if self.outer_home is not None:
            self.outer_home.send_home(owners)
        for p, grad in zip(everything, kept):
            p.grad = grad


def _gradient_for(param: nn.Parameter, gradient: Tensor) -> Tensor:
    """``gradient`` (this rank's part of ``param``'s) as ``param.grad``: a DTensor like it for a sharded parameter."""
    if hasattr(param, "to_local"):  # a DTensor: its module is loaded already
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(gradient, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return gradient


class LocalSGD(DiLoCo):
    """``with LocalSGD(model, optimizer, sync_every=H, topology=...):``: every H-th ``optimizer.step()`` (per
    fragment), the parameters become Σ_j W_ij x_j (DiLoCo with an outer SGD of learning rate 1, applied exactly; no
    anchors, so an outer step sends the model once)."""

    anchored = False

    def __init__(self, model: nn.Module, optimizer: Optimizer, sync_every: int, topology: TopologySpec = "complete",
                 **kwargs: Any):
        if isinstance(sync_every, Optimizer) or isinstance(topology, Optimizer):  # DiLoCo's order, outer included
            raise TypeError("LocalSGD takes no outer optimizer: LocalSGD(model, optimizer, sync_every, topology); "
                            "got an optimizer where sync_every or topology goes")
        super().__init__(model, optimizer, None, sync_every, topology, **kwargs)

    def _apply(self, part: list[ParameterRun]) -> None:
        for run in part:
            torch._foreach_copy_(run.params, run.first)
