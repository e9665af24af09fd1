"""DiLoCo and LocalSGD over FSDP2-sharded replicas (issue 30: the outer step over the replicas): the fronts of
``algorithms/local_steps.py`` with ``mesh=`` against the same fronts over whole models, one worker per replica given
the replica's combined batch. The whole-model fronts are checked against a float64 replay of their formulas in
``tests/test_local_steps.py`` and ``tests/test_streaming.py``; here the sharded runs must equal them (float64, 1e-10):
the outer optimizer steps the DTensor parameters with the mixed pseudo-gradient's shards, the anchors are shards.
Per-step gossip with bf16-compressed differences (CHOCO's public copies per shard; bf16 rounds elementwise, so a
shard's messages are the whole model's rows) equals the whole-model front too.
A front that handed the outer optimizer half the pseudo-gradient's shards was 0.27 (DiLoCo) and 0.31 (streaming) away
(checked once by editing ``_gradient_for``, not kept). Streaming with an exchange in flight for one inner step
(``fragment_sync_delay=1``) equals the whole-model front too; a sharded front that ignored the delay was 0.242 away.
int8 (blockwise over each rank's own shard payload, so unlike the whole model's) is checked against a float64 replay
of each rank's compressed payload instead (``_replay_int8``, audit T4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from decent_train.algorithms.local_steps import DiLoCo, LocalSGD
from decent_train.algorithms.step_gossip import Gossip
from tests.distributed import run_workers
from tests.test_sharded_gossip import D_IN, HIDDEN, Net, _batch, _loss, _optimizer

STEPS, SYNC_EVERY = 10, 4  # ends between outer steps: the replicas differ
TOLERANCE = 1e-10


def _front(model: torch.nn.Module, inner: torch.optim.Optimizer, kind: str, **kwargs: Any) -> DiLoCo:
    if kind == "gossip-bf16":  # per-step gossip of bf16-compressed differences (elementwise: shards change nothing)
        return Gossip(model, inner, "ring", compression="bf16", **kwargs)
    if kind == "localsgd":
        return LocalSGD(model, inner, SYNC_EVERY, "ring", **kwargs)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    streaming = kind.startswith("streaming")
    return DiLoCo(model, inner, outer, SYNC_EVERY, "ring", fragments=2 if streaming else 1,
                  fragment_sync_delay=1 if kind == "streaming-delayed" else 0, **kwargs)


def _sharded(rank: int, world_size: int, shard: int, kind: str, **options: Any) -> dict[str, Any]:
    """Rank ``rank`` of replica ``rank // shard`` (FSDP2 over the mesh's shard dimension); ``options`` go to the
    front (``compression=``, ``int8_block=``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = Net(seed=rank // shard)  # equal within a replica (each rank keeps its own init's shard)
    for block in (model.first, model.norm, model.second):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = _optimizer(model.parameters())
    with _front(model, inner, kind, mesh=mesh, local_world_size=world_size, **options) as front:
        for s in range(STEPS):
            _loss(model, *_batch(rank, s)).backward()
            inner.step()
            inner.zero_grad()
        anchors = [a.clone() for a in front.anchors()]
        sent = front.bytes_per_inner_step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.to_local().numel() for p in model.parameters())
    return {"params": full, "anchors": anchors, "outer_steps": front.outer_steps, "sent": sent, "numel": numel}


def _whole(rank: int, world_size: int, shard: int, kind: str) -> dict[str, Any]:
    """Replica ``rank`` as one worker: its batch is its ``shard`` ranks' micro-batches (mean loss over them)."""
    model = Net(seed=rank)
    inner = _optimizer(model.parameters())
    with _front(model, inner, kind) as front:
        for s in range(STEPS):
            parts = [_batch(rank * shard + k, s) for k in range(shard)]
            _loss(model, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])).backward()
            inner.step()
            inner.zero_grad()
        anchors = [a.clone() for a in front.anchors()]
        sent = front.bytes_per_inner_step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "anchors": anchors,
            "outer_steps": front.outer_steps, "sent": sent, "numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("kind", ["diloco", "streaming", "streaming-delayed", "localsgd", "gossip-bf16"])
def test_sharded_replicas_equal_whole_model_workers(kind: str) -> None:
    """2 replicas of 2 shards, ring; DiLoCo (Nesterov outer SGD), Streaming DiLoCo (2 fragments), LocalSGD: every
    rank's gathered model equals its replica's whole-model worker, its anchors (DiLoCo) are that worker's anchors'
    rows it holds (FSDP2 cuts dimension 0 as ``torch.chunk``), and as many outer steps were taken."""
    shard = 2
    sharded = run_workers(_sharded, 4, shard, kind)
    whole = run_workers(_whole, 2, shard, kind)
    for rank, result in enumerate(sharded):
        want = whole[rank // shard]
        deviation = max((result["params"][n] - want["params"][n]).abs().max().item() for n in want["params"])
        assert deviation <= TOLERANCE, f"rank {rank}: {deviation:.3g} from replica {rank // shard}'s worker"
        period = 1 if kind == "gossip-bf16" else SYNC_EVERY // (2 if kind.startswith("streaming") else 1)
        assert result["outer_steps"] == want["outer_steps"] == STEPS // period - (kind == "gossip-bf16")
        assert len(result["anchors"]) == len(want["anchors"]) == (0 if kind in ("localsgd", "gossip-bf16") else 6)
        if kind == "gossip-bf16":  # compressed indeed: the pair sends its shard once, in bf16 (2 bytes an element)
            assert result["sent"] == 2 * result["numel"]
        else:  # the whole-model worker's payload, cut to the shard: the ring of 2 replicas sends the delta alone
            assert result["sent"] == pytest.approx(want["sent"] * result["numel"] / want["numel"]), (result, want)
        for mine, theirs in zip(result["anchors"], want["anchors"]):
            rows = torch.chunk(theirs, shard, dim=0)[rank % shard]
            assert mine.shape == rows.shape and (mine - rows).abs().max().item() <= TOLERANCE
    first, second = (w["params"] for w in whole)
    assert max((first[n] - second[n]).abs().max().item() for n in first) > 1e-4  # gossip: replicas differ


def _moving(rank: int, world_size: int, move: bool) -> dict[str, Tensor]:
    """2 replicas of 1 shard, Streaming DiLoCo (2 fragments, an exchange in flight for one step before each outer
    step); with ``move``, every third step gives every local shard new storage with the same values
    (``module._apply(clone)``: what ``model.cpu(); model.cuda()`` does on a GPU), once while an exchange is in
    flight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = Net(seed=rank)
    for block in (model.first, model.norm, model.second):
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    inner = _optimizer(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(model, inner, outer, SYNC_EVERY, "ring", fragments=2, fragment_sync_delay=1, mesh=mesh,
                local_world_size=world_size) as front:
        for s in range(STEPS):
            _loss(model, *_batch(rank, s)).backward()
            inner.step()
            inner.zero_grad()
            if move and s % 3 == 0:  # steps 1, 4, 7, 10: after step 1 fragment 0's exchange is in flight
                model._apply(lambda t: t.clone())
        assert front.outer_steps == STEPS // (SYNC_EVERY // 2)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def test_the_front_follows_shards_that_moved() -> None:
    """Audit R9: FSDP2 gives a local shard new storage when the module is moved or cast (``model.cpu()`` and back),
    and the front must then exchange and update the new tensors. Moved every third step, the run equals the same run
    unmoved (itself equal to whole-model workers, above). A front that kept the shards it captured at construction
    (``OuterGroup.follow_params`` returning at once) missed the outer steps' updates: 0.33 away."""
    moved, still = run_workers(_moving, 2, True), run_workers(_moving, 2, False)
    for rank, (mine, want) in enumerate(zip(moved, still)):
        deviation = max((mine[n] - want[n]).abs().max().item() for n in want)
        assert deviation <= TOLERANCE, f"rank {rank}: {deviation:.3g} from the run whose shards stayed in place"


def _cast(rank: int, world_size: int) -> str:
    model = Net(seed=0)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: it steps the cast parameters as they are
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with DiLoCo(model, inner, outer, 2, "complete"):
        _loss(model, *_batch(rank, 0)).backward()
        inner.step()
        model.float()
        try:
            inner.step()  # (the gradients were cast too) the second step is an outer step
        except ValueError as error:
            return str(error)
    return "no error"


def test_a_parameter_cast_after_the_front_was_built_is_refused() -> None:
    """``model.float()`` after DiLoCo was built over a float64 model: the next outer step refuses in one line naming
    the parameter, instead of copying float32 parameters into float64 buffers and anchors."""
    (message,) = run_workers(_cast, 1)
    layout = f"({HIDDEN}, {D_IN}) on cpu"
    want = f"parameter 'first.weight' is now torch.float32 {layout}, was torch.float64 {layout}"
    assert message.startswith(want), message
    assert "\n" not in message


# -- int8 over shards: a float64 replay of each rank's compressed shard payload (audit T4) ----------------------
#
# int8 is blockwise over what one rank sends: its shards' payload, x then anchors, cut into blocks from the start of
# that buffer, one scale per block. A whole-model worker's blocks start elsewhere and take other maxima, so the
# sharded int8 run cannot equal it; it is checked here against a replay that lays out each rank's payload itself.

REPLICAS, SHARD = 2, 2
LEVELS = 127  # int8's levels each side of zero: the format's definition (engine/compress.py, Int8Compressor)
WRONG = 1e-4  # a wrong replay (variants below) is farther than this from the runs
INT8_VARIANTS = ("uncompressed", "whole_model_layout", "per_tensor_blocks")
# Streaming's 2 fragments: torchft's contiguous split of Net's 80 elements nearest the half, after first.bias (42):
# parameter indices in ``Net.parameters()`` order (first.weight, first.bias | norm.weight, norm.bias, second.*)
STREAMING_FRAGMENTS = [[0, 1], [2, 3, 4, 5]]


def _int8_round_trip(values: Tensor, block: int) -> Tensor:
    """What a receiver decodes from the int8 message of ``values`` (1-D), from the format's definition, not its
    code: zero-padded to whole blocks of ``block``; per block the float32 scale max|d| / 127 and the levels
    round(d / scale) (to nearest even; a zero block has levels 0); decoded as levels * scale."""
    rows = torch.cat([values, values.new_zeros(-values.numel() % block)]).view(-1, block)
    scale = (rows.abs().amax(1) / LEVELS).to(torch.float32).to(values.dtype).unsqueeze(1)  # the wire's float32
    levels = torch.round(rows / torch.where(scale > 0, scale, torch.ones_like(scale)))
    assert levels.abs().max() <= LEVELS
    return (levels * scale).reshape(-1)[: values.numel()]


def _int8_message_bytes(numel: int, block: int) -> int:
    """One message of ``numel`` elements: an int8 level per element of the padded blocks, a float32 scale each."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def _replay_int8(kind: str, block: int, variant: str = "exact") -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Each replica's parameters and anchors (whole, in ``Net.parameters()`` order) after STEPS inner steps of
    sharded DiLoCo with int8, in one process, float64. Replica r is one whole model from replica 0's init, stepped on
    its SHARD ranks' micro-batches (mean loss; FSDP2's reduce-scatter averages the same gradient). An outer step of
    fragment f (DiLoCo: all parameters; streaming: STREAMING_FRAGMENTS in turn, one every SYNC_EVERY / 2 steps;
    "streaming-delayed": its payload taken, compressed and mixed one inner step before its outer step):

        p_rk  = rank k of replica r's payload: its rows (``torch.chunk``, dim 0) of f's parameters, flat, then its
                rows of f's anchors, flat (the order of ``model.parameters()``)
        c_rk += Q(p_rk − c_rk)        c_rk: the public copy, starting at the first payload (every rank's equal)
        m_rk  = p_rk + ½ (c_r'k − c_rk)   the ring of 2 replicas is one pair of weight ½ (r' the other), γ = 1
        x_r  <- Nesterov SGD from the mixed anchors with gradient (mixed anchors − mixed x), joined over k;
        anchor_r <- x_r (f's parameters only; the others keep their outer momentum and anchors)

    ``variant``: "exact"; "uncompressed" (Q the identity); "whole_model_layout" (one payload per replica, as a
    whole-model worker lays it out); "per_tensor_blocks" (each parameter's and anchor's rows padded to whole blocks
    apart, as if the blocks restarted at every tensor)."""
    assert variant == "exact" or variant in INT8_VARIANTS, variant
    pieces = 1 if variant == "whole_model_layout" else SHARD
    fragments = STREAMING_FRAGMENTS if kind.startswith("streaming") else [list(range(6))]
    period, delay = SYNC_EVERY // len(fragments), 1 if kind == "streaming-delayed" else 0
    models = [Net(seed=0) for _ in range(REPLICAS)]
    inners = [_optimizer(m.parameters()) for m in models]
    outers = [torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True) for m in models]
    params = [list(m.parameters()) for m in models]
    anchors = [[p.detach().clone() for p in ps] for ps in params]

    def rows(t: Tensor, k: int) -> Tensor:
        return torch.chunk(t.detach(), pieces, dim=0)[k].reshape(-1)

    def payload(r: int, f: int, k: int) -> Tensor:
        return torch.cat([rows(params[r][i], k) for i in fragments[f]] + [rows(anchors[r][i], k) for i in fragments[f]])

    def compress(values: Tensor, f: int, k: int) -> Tensor:
        if variant == "uncompressed":
            return values.clone()
        if variant != "per_tensor_blocks":
            return _int8_round_trip(values, block)
        sizes = [rows(anchors[0][i], k).numel() for i in fragments[f]] * 2
        return torch.cat([_int8_round_trip(part, block) for part in values.split(sizes)])

    copies = {(r, f, k): payload(r, f, k)
              for r in range(REPLICAS) for f in range(len(fragments)) for k in range(pieces)}
    outer_steps, mixed = 0, []
    for s in range(STEPS):
        for r, (model, inner) in enumerate(zip(models, inners)):
            parts = [_batch(r * SHARD + k, s) for k in range(SHARD)]
            _loss(model, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])).backward()
            inner.step()
            inner.zero_grad()
        f = outer_steps % len(fragments)
        if (s + 1) % period == (period - delay) % period:  # the exchange starts: the payload now
            sent = {(r, k): payload(r, f, k) for r in range(REPLICAS) for k in range(pieces)}
            for (r, k), p in sent.items():
                copies[r, f, k] = copies[r, f, k] + compress(p - copies[r, f, k], f, k)
            mixed = [[sent[r, k] + 0.5 * (copies[1 - r, f, k] - copies[r, f, k]) for k in range(pieces)]
                     for r in range(REPLICAS)]
        if (s + 1) % period:
            continue
        with torch.no_grad():  # the outer step (``delay`` inner steps later), from what the exchange mixed
            for r in range(REPLICAS):
                split = [[h.split([rows(anchors[r][i], k).numel() for i in fragments[f]])
                          for h in m.split(m.numel() // 2)] for k, m in enumerate(mixed[r])]  # x's rows, anchors'
                for j, i in enumerate(fragments[f]):
                    p = params[r][i]
                    wx, wa = (torch.cat([split[k][h][j] for k in range(pieces)]).view_as(p) for h in (0, 1))
                    p.copy_(wa)
                    p.grad = wa - wx
                outers[r].step()
                outers[r].zero_grad(set_to_none=True)
                for i in fragments[f]:
                    anchors[r][i] = params[r][i].detach().clone()
        outer_steps += 1
    return [[p.detach().clone() for p in ps] for ps in params], anchors


def _int8_deviation(runs: list[dict[str, Any]], replay: tuple[list[list[Tensor]], list[list[Tensor]]]) -> float:
    """The largest difference over every rank of its gathered parameters from its replica's replayed ones, and of
    its anchors (its shards' rows) from the replayed anchors' rows."""
    params, anchors = replay
    worst = 0.0
    for rank, run in enumerate(runs):
        r, k = divmod(rank, SHARD)
        got = list(run["params"].values())  # named_parameters' order: parameters()'
        assert len(got) == len(params[r]) == len(run["anchors"]) == len(anchors[r])
        for mine, want in zip(got, params[r]):
            worst = max(worst, (mine - want).abs().max().item())
        for mine, want in zip(run["anchors"], anchors[r]):
            rows = torch.chunk(want, SHARD, dim=0)[k]
            assert mine.shape == rows.shape
            worst = max(worst, (mine - rows).abs().max().item())
    return worst


@pytest.mark.parametrize("kind, block", [("diloco", 16), ("streaming", 16), ("streaming-delayed", 16),
                                         ("diloco", 256)])
def test_sharded_int8_matches_a_replay_of_each_ranks_compressed_shards(kind: str, block: int) -> None:
    """Audit T4: 2 replicas x 2 shards, ring, ``compression="int8"``: DiLoCo (Nesterov outer SGD) and Streaming
    DiLoCo (2 fragments; also with an exchange in flight for one inner step). Every rank's gathered parameters and
    its anchors equal ``_replay_int8`` within TOLERANCE: float64 throughout but the scale, which both sides round to
    float32 alike, so only round-off separates them (measured 6e-16; a level that flipped would cost a whole scale).
    Blocks of 16 cut each rank's payload (2 x 48 and 2 x 32 elements; streaming 2 x 24 / 18 and 2 x 24 / 14) into
    several, across the x / anchor border and into a zero-padded last block; the default 256 holds it in one. The
    replays of an uncompressed exchange, of the whole model's layout and of blocks restarting at every tensor are
    farther than WRONG (measured 1.3e-3 to 2.9e-3): the check tells the layouts apart. Bytes: each fragment's message
    once per SYNC_EVERY inner steps (a pair sends it once), sized by hand."""
    runs = run_workers(_sharded, REPLICAS * SHARD, SHARD, kind, compression="int8", int8_block=block)
    deviation = _int8_deviation(runs, _replay_int8(kind, block))
    assert deviation <= TOLERANCE, f"{deviation:.3g} from the replay of each rank's int8 shard payload"
    for variant in INT8_VARIANTS:
        wrong = _int8_deviation(runs, _replay_int8(kind, block, variant))
        assert wrong > WRONG, f"the {variant} replay is only {wrong:.3g} from the runs: the check cannot tell it apart"
    fragments = STREAMING_FRAGMENTS if kind.startswith("streaming") else [list(range(6))]
    shapes = [p.shape for p in Net(seed=0).parameters()]
    for rank, run in enumerate(runs):
        k = rank % SHARD
        numels = [sum(torch.empty(shapes[i]).chunk(SHARD, dim=0)[k].numel() for i in f) for f in fragments]
        assert run["numel"] == sum(numels)
        assert run["sent"] == sum(_int8_message_bytes(2 * n, block) for n in numels) / SYNC_EVERY, (rank, run["sent"])
        assert run["outer_steps"] == STEPS // (SYNC_EVERY // len(fragments))
