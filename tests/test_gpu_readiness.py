"""Defects a reading of the engine against torch's NCCL code found (shared/notes/gpu-audit.md), checked on CPU.

Each test observes the behaviour that breaks or stalls a GPU run (which tensors a collective gets, how many host syncs
a step makes, how a wait is issued) against an independent oracle, and failed on the code before the fix.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from decent_train import DecentralizedDataParallel, ExchangeError
from decent_train.components.metrics import ConsensusProbe
from decent_train.engine.comm import CommWaits
from decent_train.engine.membership import Membership
from decent_train.launcher.launch import check_devices, default_threads_per_worker
from tests.distributed import run_workers


def spy_all_reduce(calls: list[tuple[int, torch.dtype, str]]) -> None:
    """Record (numel, dtype, device type) of every ``dist.all_reduce`` in this (forked) process."""
    real = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((tensor.numel(), tensor.dtype, tensor.device.type))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording  # type: ignore[assignment]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def train(engine: nn.Module, steps: int, rank: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = batch(100 * step + rank)
        ((engine(x) - y) ** 2).mean().backward()


# -- entering all-reduce with Adam ----------------------------------------------------------------------------------
def test_entering_allreduce_averages_moments_but_not_step_counters() -> None:
    """torch's Adam keeps ``step`` as a CPU tensor: on NCCL an all-reduce of it fails. Only the moments (on the
    parameters' device) are averaged; the oracle is the mean of the workers' moments gathered before the switch."""

    def run(rank: int, world: int) -> dict:
        engine = DecentralizedDataParallel(
            mlp(), lambda named: torch.optim.Adam([p for _, p in named], lr=1e-2), topology="ring", bucket_size_in_mb=0
        )
        train(engine, 3, rank)
        moments = {
            (b, key): torch.stack([opt.state[p][key].clone() for p in opt.state]).flatten()
            for b, opt in enumerate(engine.optimizers) for key in ("exp_avg", "exp_avg_sq")
        }
        steps_before = [float(opt.state[p]["step"]) for opt in engine.optimizers for p in opt.state]
        gathered = {k: [torch.empty_like(v) for _ in range(world)] for k, v in moments.items()}
        for k, v in moments.items():
            dist.all_gather(gathered[k], v)
        calls: list[tuple[int, torch.dtype, str]] = []
        spy_all_reduce(calls)
        engine.switch_to("allreduce")
        after = {
            (b, key): torch.stack([opt.state[p][key] for p in opt.state]).flatten()
            for b, opt in enumerate(engine.optimizers) for key in ("exp_avg", "exp_avg_sq")
        }
        return {
            "calls": calls,
            "bucket_numel": sum(b.flat.numel() for b in engine._buckets),
            "param_numel": sum(p.numel() for p in engine.parameters()),
            "want": {k: torch.stack(v).mean(0) for k, v in gathered.items()},
            "after": after,
            "steps": (steps_before, [float(opt.state[p]["step"]) for opt in engine.optimizers for p in opt.state]),
        }

    for result in run_workers(run, 2):
        reduced = sum(numel for numel, _, _ in result["calls"])
        # The parameters' global average (the flat buckets), then exp_avg and exp_avg_sq of every parameter.
        assert reduced == result["bucket_numel"] + 2 * result["param_numel"], result["calls"]
        assert all(numel > 1 for numel, _, _ in result["calls"]), "a step counter was all-reduced"
        for key, want in result["want"].items():
            assert torch.allclose(result["after"][key], want, rtol=1e-6, atol=1e-12), key
        assert result["steps"][0] == result["steps"][1] == [3.0] * len(result["steps"][0])


# -- fp16 loss scaling: one host sync per step -----------------------------------------------------------------------
def test_fp16_reads_the_overflow_flag_once_per_step_and_trains_like_a_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradScaler.step reads its overflow flag on the host once per optimizer, i.e. once per bucket. The engine reads
    the (already agreed) flag once per step; the oracle for the values is a plain loop with the same GradScaler."""

    def sgd(named: list) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(step)
        return (x * (math.inf if step == 2 else 1.0)), y  # step 2 overflows: skipped, the scale halves

    plain = mlp()
    plain_opt, plain_scaler = sgd(list(plain.named_parameters())), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(5):
        x, y = data(step)
        plain_scaler.scale(((plain(x) - y) ** 2).mean()).backward()
        plain_scaler.step(plain_opt)
        plain_scaler.update()
        plain_opt.zero_grad()

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    engine = DecentralizedDataParallel(mlp(), sgd, scaler=scaler, bucket_size_in_mb=0)  # one process: world size 1
    assert len(engine.bucket_bytes) == 6
    syncs = []
    real_item = torch.Tensor.item

    def counting_item(self: torch.Tensor) -> Any:
        syncs.append(1)
        return real_item(self)

    for step in range(5):
        x, y = data(step)
        loss = scaler.scale(((engine(x) - y) ** 2).mean())
        syncs.clear()
        monkeypatch.setattr(torch.Tensor, "item", counting_item)
        loss.backward()  # every bucket steps in here
        monkeypatch.setattr(torch.Tensor, "item", real_item)
        assert len(syncs) == 1, f"step {step}: {len(syncs)} host syncs"
    assert scaler.get_scale() == plain_scaler.get_scale() == 2.0**7
    for (name, mine), want in zip(engine.named_parameters(), plain.parameters()):
        assert torch.allclose(mine, want, rtol=1e-6, atol=1e-7), name


# -- waits ----------------------------------------------------------------------------------------------------------
class FakeWork:
    def __init__(self) -> None:
        self.waits: list[tuple] = []

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True


class FakeEvent:
    """Stands for a CUDA event (none here): completes at once, 2 ms after the event recorded before it."""

    recorded: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.time = 0.0

    def record(self) -> None:
        FakeEvent.recorded.append(self)
        self.time = 2.0 * len(FakeEvent.recorded)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.time - self.time


def test_gpu_waits_leave_the_host_alone_and_time_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a timed wait makes ProcessGroupNCCL poll on the host once per bucket: the engine must call a plain
    ``wait()`` (the stream waits; the group's timeout is the limit) and time the stall with events on the stream."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.recorded = []
    waits = CommWaits(timedelta(seconds=5))
    works = [FakeWork(), FakeWork()]
    for _ in range(3):
        waits.wait(works, torch.device("cuda", 0))
    assert all(w.waits == [(), (), ()] for w in works)
    assert waits.seconds == pytest.approx(3 * 0.002)  # each (start, end) pair: 2 ms apart

    cpu_waits = CommWaits(timedelta(seconds=5))
    cpu_work = FakeWork()
    cpu_work.wait = lambda *args: (cpu_work.waits.append(args), time.sleep(0.05))  # type: ignore[method-assign]
    cpu_waits.wait([cpu_work], torch.device("cpu"))
    assert cpu_work.waits == [(timedelta(seconds=5),)]  # gloo: the host waits, with the exchange limit
    assert cpu_waits.seconds >= 0.05


LATE_S = 0.5  # rank 1's sleep before each step of the stall test


def test_engine_records_its_stall_through_the_waits() -> None:
    """``comm_wait_seconds`` grows with a peer that is late (perf_counter on CPU): from a barrier on, rank 1 sleeps
    LATE_S before each of 4 steps. Rank 0 waits for rank 1's previous step in steps 1-3: about 3 x LATE_S, less only
    the time rank 0 itself is slowed down, so more than 1 x LATE_S leaves 2 x LATE_S for a loaded machine. Rank 1
    waits for no one (rank 0 is LATE_S ahead at every step): under 1 x LATE_S, where its own sleeps, if counted, make
    4 x LATE_S. The barrier: building the engine takes 3-7 s on 2 loaded cores and the ranks end it up to 0.7 s
    apart, which rank 1's first sleeps would otherwise absorb."""

    def run(rank: int, world: int) -> float:
        engine = DecentralizedDataParallel(mlp(), lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                           topology="ring", timeout=30)
        dist.barrier()
        for step in range(4):
            if rank == 1:
                time.sleep(LATE_S)
            train(engine, 1, rank, first=step)
        return engine.comm_wait_seconds

    stalls = run_workers(run, 2)
    assert stalls[0] > LATE_S > stalls[1], stalls


# -- timeouts -------------------------------------------------------------------------------------------------------
def _join_as_the_worker_and_wait(rank: int, port: int, path: str) -> None:
    """A forked worker: join as ``decent_train.worker`` does, then a barrier and an exchange that wait 3 s for rank 1."""
    from decent_train.config import TrainConfig
    from decent_train.runtime import init_distributed

    outcome = "no error"
    try:
        cfg = TrainConfig(comm_timeout_s=1.0, pg_timeout_s=30.0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        torch.set_num_threads(1)
        init_distributed("cpu", timedelta(seconds=cfg.pg_timeout_s))
        if rank == 1:
            time.sleep(3)
        dist.barrier()  # longer than comm_timeout_s: must pass
        engine = DecentralizedDataParallel(mlp(), lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                           topology="ring", timeout=cfg.comm_timeout_s)
        train(engine, 1, rank)
        if rank == 1:
            time.sleep(3)
        else:
            train(engine, 2, rank, first=1)  # step 2 waits for the exchange rank 1 has not started
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(error).__name__}: {error}"
    with open(os.path.join(path, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    os._exit(0)


def test_process_group_timeout_is_separate_from_the_exchange_limit(tmp_path: Any) -> None:
    """The worker joins with ``pg_timeout_s`` (long: a slow checkpoint is no failure) while the engine's exchanges
    fail after ``comm_timeout_s``. Two workers: a barrier that waits 3 s passes; an exchange that waits 3 s with a 1 s
    limit fails with one ExchangeError line."""
    import multiprocessing

    port = 29000 + os.getpid() % 2000
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_join_as_the_worker_and_wait, args=(r, port, str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert rank0.startswith("ExchangeError: rank 0: the exchange of bucket 0 with rank(s) [1] at step 2 failed (a "
                            "peer hangs or died, limit 1 s)"), rank0
    assert "\n" not in rank0
    assert (tmp_path / "rank1.txt").read_text() == "no error"


# -- load_state_dict during training ---------------------------------------------------------------------------------
def test_load_state_dict_drops_the_exchange_in_flight() -> None:
    """After ``load_state_dict(S)`` on every worker, the models are S: with the learning rate at 0, S must stay S.
    Before the fix the next step mixed in what the peer sent before the load."""

    def run(rank: int, world: int) -> float:
        engine = DecentralizedDataParallel(mlp(seed=rank), lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                           topology="ring")
        train(engine, 3, rank)  # the workers differ, and an exchange is in flight
        state = {k: v.clone() for k, v in mlp(seed=7).state_dict().items()}
        engine.load_state_dict(state)
        for optimizer in engine.optimizers:
            optimizer.param_groups[0]["lr"] = 0.0
        train(engine, 2, rank, first=3)
        return max((engine.state_dict()[k] - v).abs().max().item() for k, v in state.items())

    assert run_workers(run, 2) == [0.0, 0.0]


# -- global average of buffers ----------------------------------------------------------------------------------------
def test_global_avg_averages_all_buffers_in_one_all_reduce() -> None:
    """One all-reduce per bucket and one for every floating-point buffer together (was one per BatchNorm
    statistic); the oracle for the values is the mean of the gathered buffers."""

    def run(rank: int, world: int) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(4, 4), nn.BatchNorm1d(4))])
        engine = DecentralizedDataParallel(model, lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                           sync_buffer_in_global_avg=True, bucket_size_in_mb=1)
        engine(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        buffers = torch.cat([b.flatten() for b in model.buffers() if b.is_floating_point()])
        gathered = [torch.empty_like(buffers) for _ in range(world)]
        dist.all_gather(gathered, buffers)
        calls: list = []
        spy_all_reduce(calls)
        engine.global_avg(will_revert=False)
        after = torch.cat([b.flatten() for b in model.buffers() if b.is_floating_point()])
        return {"calls": len(calls), "buckets": len(engine.bucket_bytes), "error":
                (after - torch.stack(gathered).mean(0)).abs().max().item(), "differed": (gathered[0] - gathered[1]).abs().max().item()}

    for result in run_workers(run, 2):
        assert result["calls"] == result["buckets"] + 1
        assert result["differed"] > 0 and result["error"] < 1e-6


# -- consensus distance at a GPU's cost ---------------------------------------------------------------------------------
def test_consensus_probe_is_exact_on_small_models_and_estimates_large_ones_from_a_sample() -> None:
    """Oracle: the exact distance from the gathered parameters. The default sample all-reduces at most 65,536
    numbers whatever the model's size (it all-reduced the whole model before), and estimates the distance within a
    few percent where deviations are spread over the model."""

    def run(rank: int, world: int) -> dict:
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(300, 500, generator=g), torch.randn(1000, generator=g),
                  torch.randn(8, 16, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)]
        mine = torch.cat([p.flatten() for p in params]).double()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        stacked = torch.stack(every)
        mean = stacked.mean(0)
        exact = math.sqrt(((stacked - mean) ** 2).sum(1).mean().item())
        calls: list = []
        spy_all_reduce(calls)
        sampled = ConsensusProbe(params).measure()
        full = ConsensusProbe(params, samples=0).measure()
        return {"exact": (exact, exact / mean.norm().item()), "sampled": sampled, "full": full, "calls": calls}

    results = run_workers(run, 3)
    for result in results:
        assert result["full"][0] == pytest.approx(result["exact"][0], rel=1e-5)
        assert result["full"][1] == pytest.approx(result["exact"][1], rel=1e-5)
        assert result["sampled"][0] == pytest.approx(result["exact"][0], rel=0.03)
        assert result["sampled"][1] == pytest.approx(result["exact"][1], rel=0.03)
        sampled_calls = result["calls"][:2]
        assert [numel for numel, _, _ in sampled_calls] == [65536, 2]
    assert len({r["sampled"] for r in results}) == 1  # every rank reports the same value


# -- threads per worker ---------------------------------------------------------------------------------------------
def test_threads_per_worker_come_from_the_cpus_this_job_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SLURM job given 8 of a node's 128 CPUs must not start 4 workers with 32 threads each."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_threads_per_worker(4) == 2
    assert default_threads_per_worker(16) == 1


def test_more_workers_than_gpus_is_refused_before_any_worker() -> None:
    """Workers took ``LOCAL_RANK % device_count`` as their GPU, so two shared one until NCCL failed."""
    with pytest.raises(ValueError, match=r"launch.nproc_per_node=8 but this node has 4 GPU\(s\); valid: 1..4"):
        check_devices("cuda", 8, True, 4)
    with pytest.raises(ValueError, match="launch.nproc_per_node=2 but this node has 1 GPU"):
        check_devices("auto", 2, True, 1)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        check_devices("cuda", 1, False, 0)
    check_devices("cuda", 4, True, 4)
    check_devices("auto", 4, False, 0)  # auto without CUDA: CPU workers
    check_devices("cpu", 16, True, 1)


def test_the_gpu_exchange_group_carries_the_limit_and_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the engine exchanges (pairs, groups, gradient all-reduce) in process groups that carry the exchange
    limit. Forced on here with gloo: the same parameters as through the default group, and the groups' timeout is
    the limit (ranks 0-2 of a ring of 3 form one group of three: a group, not a pair)."""

    def run(rank: int, world: int, forced: bool) -> dict:
        if forced:
            Membership.engine_group_timeout = lambda self, device: self.timeout  # type: ignore[method-assign]
        out = {}
        for topology in ("ring", "allreduce"):
            engine = DecentralizedDataParallel(mlp(), lambda n: torch.optim.SGD([p for _, p in n], lr=0.1),
                                               topology=topology, timeout=7)
            train(engine, 3, rank)
            out[topology] = torch.cat([p.detach().flatten() for p in engine.parameters()])
            exchange_group, stages = engine._members.exchange_group, getattr(engine._mode, "my_stages", [])
            out[f"{topology}_world_edge_uses_the_exchange_group"] = exchange_group is not None and all(
                e.group is exchange_group for edges in stages for e in edges
            )  # ring at 3 is one group of every rank each round: no second copy of the world
            groups = [e.group for edges in stages for e in edges if e.group is not None]
            out[f"{topology}_timeouts"] = [
                g._get_backend(torch.device("cpu")).options._timeout
                for g in groups + ([exchange_group] if exchange_group is not None else [])
            ]
        return out

    plain, forced = run_workers(run, 3, False), run_workers(run, 3, True)
    for a, b in zip(plain, forced):
        assert torch.equal(a["ring"], b["ring"]) and torch.equal(a["allreduce"], b["allreduce"])
    assert plain[0]["ring_timeouts"] == []
    assert forced[0]["ring_timeouts"] and all(t == timedelta(seconds=7) for t in forced[0]["ring_timeouts"])
    assert forced[0]["ring_world_edge_uses_the_exchange_group"]
