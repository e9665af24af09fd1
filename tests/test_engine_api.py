"""The engine's API beyond the recurrence: torch DDP equivalence, global_avg, pre_average_hook, state_dict, errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from decent_train import (
    DecentralizedDataParallel,
    Edge,
    Topology,
    lr_scheduler_fn_cosine_with_warmup,
    topology_names,
)
from tests.distributed import WorkerError, run_workers
from tests.replay import (
    SEED,
    SGD,
    loss_fn,
    make_model,
    max_deviation,
    replay,
    single_process,
    snapshot,
    topology_for,
    train_engine,
)

TOL = 1e-12
SCHEDULE = partial(lr_scheduler_fn_cosine_with_warmup, t_max=10, t_warmup=3)


def same_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)


def test_complete_sgd_matches_torch_ddp() -> None:
    """With the same batch on every worker, `complete` gossip must be exactly all-reduce SGD.

    (With different batches the two algorithms differ by design: gossip takes each worker's gradient at its own
    parameters, all-reduce at the shared ones; tests/test_engine_replay.py checks that case against the replay.)
    """
    steps = 12

    def run(rank: int, world_size: int) -> dict:
        ours = DecentralizedDataParallel(make_model(SEED + rank), SGD, SCHEDULE, topology="complete",
                                         bucket_size_in_mb=0.0005)
        reference_model = make_model(SEED + rank)
        reference = nn.parallel.DistributedDataParallel(reference_model)  # broadcasts rank 0's parameters too
        optimizer = SGD(list(reference_model.named_parameters()))
        scheduler = SCHEDULE(optimizer)
        for s in range(steps):
            x, y = same_batch(s)
            ((ours(x) - y) ** 2).mean().backward()
            optimizer.zero_grad()
            ((reference(x) - y) ** 2).mean().backward()
            optimizer.step()
            scheduler.step()
        return {
            "deviation": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), reference_model.parameters())),
            "moved": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), make_model(SEED).parameters())),
            "lr": (ours.get_lr(), scheduler.get_last_lr()[0]),
        }

    for result in run_workers(run, 4):
        assert result["moved"] > 1e-3
        assert result["deviation"] <= TOL
        assert result["lr"][0] == pytest.approx(result["lr"][1], abs=TOL)


def mean_of(workers: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([w[k] for w in workers]).mean(0) for k in workers[0]}


def test_global_avg_revert_and_continue() -> None:
    """global_avg gives the exact average and the distance to it; revert restores; training goes on unchanged."""
    before, after = 5, 12

    def run(rank: int, world_size: int) -> dict:
        ddp = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology="ring", bucket_size_in_mb=0.0005)
        for s in range(before):
            loss_fn(ddp, rank, s).backward()
        d2c = ddp.global_avg(will_revert=True, return_d2c=True)
        averaged = snapshot(ddp)
        ddp.revert_global_avg()
        reverted = snapshot(ddp)
        for s in range(before, after):
            loss_fn(ddp, rank, s).backward()
        return {"d2c": d2c, "averaged": averaged, "reverted": reverted,
                "final": snapshot(ddp)}

    results = run_workers(run, 4)
    at_before = replay(topology_for("ring", 4), before)
    at_after = replay(topology_for("ring", 4), after)
    mean = mean_of(at_before)
    for rank, result in enumerate(results):
        for k in mean:
            assert (result["averaged"][k] - mean[k]).abs().max() <= TOL
            assert (result["reverted"][k] - at_before[rank][k]).abs().max() <= TOL
            assert (result["final"][k] - at_after[rank][k]).abs().max() <= TOL
        distance = torch.cat([(mean[k] - at_before[rank][k]).flatten() for k in mean]).norm().item()
        assert distance > 1e-4 and result["d2c"] == pytest.approx(distance, rel=1e-9)


@pytest.mark.parametrize("forget_revert", [False, True])
def test_global_avg_without_revert_continues_from_the_average(forget_revert: bool) -> None:
    """will_revert=False (or forgetting revert_global_avg) restarts the recurrence from the exact average."""
    steps, at = 10, 4

    def run(rank: int, world_size: int) -> dict:
        if not forget_revert:
            return train_engine(rank, world_size, "ring", steps, average_before_step=at)
        ddp = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology="ring", bucket_size_in_mb=0.0005)
        for s in range(steps):
            if s == at:
                ddp.global_avg()  # will_revert=True, but no revert_global_avg() follows
            loss_fn(ddp, rank, s).backward()
        return {"params": snapshot(ddp)}

    expected = replay(topology_for("ring", 4), steps, average_before_step=at)
    assert max_deviation(run_workers(run, 4), expected) <= TOL


def test_global_avg_syncs_and_restores_buffers() -> None:
    def run(rank: int, world_size: int) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
        ddp = DecentralizedDataParallel(model, SGD, topology="complete", sync_buffer_in_global_avg=True)
        g = torch.Generator().manual_seed(rank)
        ddp(torch.randn(8, 4, generator=g, dtype=torch.float64) * (rank + 1)).sum().backward()
        local = model[1].running_var.clone()
        ddp.global_avg()
        averaged = model[1].running_var.clone()
        ddp.revert_global_avg()
        return {"local": local, "averaged": averaged, "reverted": model[1].running_var.clone()}

    results = run_workers(run, 2)
    mean = (results[0]["local"] + results[1]["local"]) / 2
    assert not torch.allclose(results[0]["local"], results[1]["local"])
    for r in results:
        assert torch.allclose(r["averaged"], mean, atol=TOL, rtol=0)
        assert torch.equal(r["reverted"], r["local"])


class RecordingSGD(torch.optim.SGD):
    """An optimizer using decent-dp's extension point: it sees each parameter's comm_buffer before the mix."""

    def __init__(self, named: list, log: list) -> None:
        super().__init__([p for _, p in named], lr=0.05)
        self.names = [n for n, _ in named]
        self.log = log

    def pre_average_hook(self, edge: Edge, weight: float) -> None:
        for name, p in zip(self.names, self.param_groups[0]["params"]):
            self.log.append((name, tuple(edge.ranks), weight, p.detach().clone(), p.comm_buffer.clone()))


@pytest.mark.parametrize("topology", ["ring", "complete"])
def test_pre_average_hook_sees_the_weighted_group_sum(topology: str) -> None:
    """decent-dp's contract: at the hook, comm_buffer = (1-w)/(m-1) * (sum of the group's parameters), x_i un-mixed."""

    def run(rank: int, world_size: int) -> list:
        log: list = []
        ddp = DecentralizedDataParallel(make_model(SEED + rank), lambda named: RecordingSGD(named, log),
                                        topology=topology, bucket_size_in_mb=0.0005)
        for s in range(4):
            loss_fn(ddp, rank, s).backward()
        return log

    logs = run_workers(run, 4)
    per_param = len(logs[0]) // 3  # steps 1, 2, 3 mix (step 0's mix is the identity)
    assert per_param == len(list(make_model().parameters()))
    for i in range(len(logs[0])):
        for rank, log in enumerate(logs):
            name, group, weight, own, comm = log[i]
            assert rank in group and weight == pytest.approx(1 / len(group))
            expected = sum(logs[j][i][3] for j in group) * (1 - weight) / (len(group) - 1)
            assert logs[group[0]][i][0] == name
            assert (comm - expected).abs().max() <= TOL


def test_state_dict_is_the_bare_models() -> None:
    ddp = DecentralizedDataParallel(make_model(1), SGD)
    bare = make_model(2)
    bare.load_state_dict(ddp.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(bare.parameters(), ddp.parameters()))
    prefixed = {f"_model.{k}": v * 2 for k, v in make_model(3).state_dict().items()}  # as decent-dp saves
    ddp.load_state_dict(prefixed)
    assert all(torch.equal(a, b * 2) for a, b in zip(ddp.parameters(), make_model(3).parameters()))
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in bare.named_parameters()]


def test_unknown_topology_lists_the_registered_names() -> None:
    with pytest.raises(ValueError, match="unknown topology 'rnig'") as error:
        DecentralizedDataParallel(make_model(), SGD, topology="rnig")
    assert all(name in str(error.value) for name in topology_names())


def test_a_world_size_the_topology_cannot_serve() -> None:
    def run(rank: int, world_size: int) -> None:
        DecentralizedDataParallel(make_model(), SGD, topology="one-peer-exp")

    with pytest.raises(WorkerError, match=r"ValueError: topology 'one-peer-exp' needs a power-of-two number of workers"
                       r" \(1, 2, 4, 8, \.\.\.\); got 3"):
        run_workers(run, 3)


def test_an_invalid_custom_topology() -> None:
    class Overlapping(Topology):
        def _get_topo_edges(self) -> list[list[Edge]]:
            return [[Edge([0]), Edge([0])]]

    with pytest.raises(ValueError, match="round 0 puts rank 0 in more than one group"):
        DecentralizedDataParallel(make_model(), SGD, topology=Overlapping)


@pytest.mark.parametrize("kwargs, message", [
    (dict(grad_clip_norm=-1.0), "grad_clip_norm must be >= 0"),
    (dict(bucket_size_in_mb=-5), "bucket_size_in_mb must be >= 0"),
    (dict(global_avg_every=-1), "global_avg_every must be >= 0"),
    (dict(message_size_in_mb=-1), "message_size_in_mb must be >= 0"),
])
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecentralizedDataParallel(make_model(), SGD, **kwargs)


def test_too_many_messages_per_bucket() -> None:
    model = nn.Linear(300, 300).double()  # 722 kB: more than 65536 messages of one byte
    with pytest.raises(ValueError, match="messages, more than 65536"):
        DecentralizedDataParallel(model, SGD, message_size_in_mb=2**-20)


def test_different_models_on_different_ranks_are_reported() -> None:
    def run(rank: int, world_size: int) -> None:
        model = make_model() if rank == 0 else nn.Sequential(nn.Linear(8, 3)).double()
        DecentralizedDataParallel(model, SGD)

    with pytest.raises(WorkerError, match="rank 1's model differs from rank 0's"):
        run_workers(run, 2)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.conv = nn.Conv2d(2, 4, 3)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))).flatten(1))


def conv_loss(model: nn.Module, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(it)
    x, y = torch.randn(6, 2, 6, 6, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    return ((model(x) - y) ** 2).mean()


def channels_last_convnet() -> nn.Module:
    return ConvNet().double().to(memory_format=torch.channels_last)


def test_channels_last_parameters_keep_their_layout_and_train() -> None:
    def run(rank: int, world_size: int) -> dict:
        ddp = DecentralizedDataParallel(channels_last_convnet(), SGD, topology="complete", bucket_size_in_mb=0)
        weight = ddp.module.conv.weight
        layout = weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
        for it in range(4):
            conv_loss(ddp, it).backward()
        return {"layout": layout, "params": snapshot(ddp)}

    results = run_workers(run, 2)
    assert all(result["layout"] for result in results)
    assert max_deviation(results, [single_process(channels_last_convnet(), 4, conv_loss)] * 2) <= TOL


def test_no_sync_accumulates_like_set_accumulate_grad() -> None:
    steps, micro = 6, 3

    def run(rank: int, world_size: int) -> dict:
        ddp = DecentralizedDataParallel(make_model(SEED + rank), SGD, topology="ring", bucket_size_in_mb=0.0005)
        for s in range(steps):
            with ddp.no_sync():
                for m in range(micro - 1):
                    loss_fn(ddp, rank, s, m).backward()
            loss_fn(ddp, rank, s, micro - 1).backward()
        return {"params": snapshot(ddp)}

    expected = replay(topology_for("ring", 4), steps, micro_batches=micro)
    assert max_deviation(run_workers(run, 4), expected) <= TOL


@pytest.mark.parametrize("module", ["ddp", "optim", "topo", "utils"])
def test_every_public_name_of_decent_dp_exists_after_the_import_swap(module: str) -> None:
    """decent-dp 0.2.3's own public names (those it defines, not what it imports from torch or typing), read from
    the installed decent-dp: a script that imports any of them runs after replacing ``decent_dp`` by ``decent_train``."""
    import importlib

    theirs, ours = importlib.import_module(f"decent_dp.{module}"), importlib.import_module(f"decent_train.{module}")
    public = [n for n in dir(theirs) if not n.startswith("_")
              and getattr(getattr(theirs, n), "__module__", "").startswith("decent_dp")]
    assert public, f"decent_dp.{module} defines no public name: the oracle read nothing"
    assert [n for n in public if not hasattr(ours, n)] == []
