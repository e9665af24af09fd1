"""Resuming with another ``steps=`` (or another warmup): the LR schedule after the resume is the new configuration's,
at the checkpoint's position, as if the run had been configured that way from the start.

Oracle: torch's own scheduler built from the new configuration on a throwaway optimizer and stepped from 0; every
parameter group of every bucket must use exactly its LR at every step after the resume. With the configuration
unchanged, the resume stays bit-identical to an uninterrupted run (the saved state is loaded as it is).
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from decent_train import DecentralizedDataParallel, optim_fn_adamw, optim_fn_sgd
from decent_train.components.optim import SchedulerConfig, make_scheduler_fn
from decent_train.engine.schedule_resume import load_scheduler_state
from tests.distributed import run_workers
from tests.jobs import make_cfg, records, train_on_cpu
from tests.replay import SEED, loss_fn, make_model, snapshot

LR = 0.01
OPTIMS = {"adamw": partial(optim_fn_adamw, lr=LR, weight_decay=0.01),
          "sgd": partial(optim_fn_sgd, lr=LR, momentum=0.9, weight_decay=1e-3)}
NO_WARMUP = SchedulerConfig(warmup_steps=0, warmup_fraction=0.0)


def oracle(
    cfg: SchedulerConfig, total: int, positions: int, lr: float = LR, groups: int = 1
) -> tuple[list[float], dict[str, Any]]:
    """The LR at positions 0..``positions`` of a run of ``total`` steps configured so from the start, and the
    scheduler's state at the last: torch's scheduler on a throwaway optimizer of ``groups`` parameter groups."""
    optimizer = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=lr)
    scheduler = make_scheduler_fn(cfg, total)(optimizer)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(positions):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs, scheduler.state_dict()


def _engine(optim: str, cfg: SchedulerConfig, total: int) -> DecentralizedDataParallel:
    return DecentralizedDataParallel(make_model(SEED), OPTIMS[optim], make_scheduler_fn(cfg, total),
                                     topology="complete", bucket_size_in_mb=0.0005)


def _lrs(engine: DecentralizedDataParallel) -> list[list[float]]:
    return [[group["lr"] for group in optimizer.param_groups] for optimizer in engine.optimizers]


def _resume_engine(rank: int, world: int, optim: str, first: tuple[SchedulerConfig, int],
                   then: tuple[SchedulerConfig, int], taken: int) -> dict[str, Any]:
    """``taken`` steps of a run configured ``first``, a checkpoint, and the rest of a run configured ``then`` from
    it: the LRs of every bucket's groups before each step after the resume and at the end, the schedulers' states."""
    old = _engine(optim, *first)
    for s in range(taken):
        loss_fn(old, rank, s).backward()
    model_state = {k: v.clone() for k, v in old.state_dict().items()}
    engine_state = copy.deepcopy(old.engine_state_dict())
    new = _engine(optim, *then)
    new.load_state_dict(model_state)
    new.load_engine_state_dict(engine_state)
    lrs = []
    for s in range(taken, then[1]):
        lrs.append(_lrs(new))
        loss_fn(new, rank, s).backward()
    lrs.append(_lrs(new))
    return {"lrs": lrs, "buckets": len(new.optimizers), "step": new.step_count,
            "schedulers": [(len(s.optimizer.param_groups), s.state_dict()) for s in new.lr_schedulers]}


CHANGES = {  # first (config, total steps), then (config, total steps), steps taken before the checkpoint, optimizer
    "longer after the end": ((SchedulerConfig(warmup_steps=2), 8), (SchedulerConfig(warmup_steps=2), 20), 8, "adamw"),
    "longer in the middle, sgd": ((SchedulerConfig(warmup_steps=2), 10), (SchedulerConfig(warmup_steps=2), 16), 5,
                                  "sgd"),
    "warmup fraction grows past the step": ((SchedulerConfig(warmup_fraction=0.2), 10),
                                            (SchedulerConfig(warmup_fraction=0.2), 30), 4, "adamw"),
    "warmup 0 to 3": ((SchedulerConfig(warmup_fraction=0.1), 6), (SchedulerConfig(warmup_fraction=0.1), 30), 6,
                      "adamw"),
    "warmup 2 to 0": ((SchedulerConfig(warmup_steps=2), 8), (NO_WARMUP, 16), 8, "sgd"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_resume_with_other_steps_follows_the_new_schedule_from_the_saved_step(change: str) -> None:
    first, then, taken, optim = CHANGES[change]
    result = run_workers(_resume_engine, 1, optim, first, then, taken)[0]
    expected, _ = oracle(*then, then[1])
    assert result["buckets"] >= 3 and result["step"] == then[1]
    assert len(result["lrs"]) == then[1] - taken + 1
    for position, lrs in enumerate(result["lrs"], start=taken):
        for bucket in lrs:
            assert bucket == [expected[position]] * len(bucket), f"step {position}"
    # The next checkpoint holds the new schedule: a later resume with the same configuration loads it as it is.
    for groups, state in result["schedulers"]:
        assert state == oracle(*then, then[1], groups=groups)[1]


def _same_config(rank: int, world: int) -> dict[str, Any]:
    cfg, total, taken = SchedulerConfig(warmup_steps=2), 10, 4
    whole = _engine("adamw", cfg, total)
    for s in range(total):
        loss_fn(whole, rank, s).backward()
    resumed = _resume_engine(rank, world, "adamw", (cfg, total), (cfg, total), taken)
    return {"whole": [(len(s.optimizer.param_groups), s.state_dict()) for s in whole.lr_schedulers],
            "resumed": resumed["schedulers"],
            "whole_lr": _lrs(whole), "resumed_lr": resumed["lrs"][-1]}


def test_a_resume_with_the_same_schedule_is_bit_identical_to_an_uninterrupted_run() -> None:
    result = run_workers(_same_config, 1)[0]
    assert result["resumed"] == result["whole"]
    assert result["resumed_lr"] == result["whole_lr"]


def _optimizer_and_scheduler(cfg: SchedulerConfig, total: int, lr: float = LR) -> tuple[Any, Any]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    return optimizer, make_scheduler_fn(cfg, total)(optimizer)


def test_loading_the_same_configuration_loads_the_saved_state_as_it_is() -> None:
    optimizer, scheduler = _optimizer_and_scheduler(SchedulerConfig(warmup_steps=2), 10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    saved = copy.deepcopy(scheduler.state_dict())
    saved["_last_lr"] = [123.0]  # marks the state: it is loaded unchanged, nothing is recomputed
    _, fresh = _optimizer_and_scheduler(SchedulerConfig(warmup_steps=2), 10)
    load_scheduler_state(fresh, saved, make_scheduler_fn(SchedulerConfig(warmup_steps=2), 10), {})
    assert fresh.state_dict() == saved


def test_the_new_schedule_is_stepped_once_for_buckets_of_the_same_configuration() -> None:
    """Stepping a schedule to a late step costs ~1-2 s per 100k steps: once per load, not once per bucket."""
    optimizer, scheduler = _optimizer_and_scheduler(SchedulerConfig(warmup_steps=2), 10)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    built: list[Any] = []
    schedule = make_scheduler_fn(SchedulerConfig(warmup_steps=2), 40)

    def counted(opt: torch.optim.Optimizer) -> Any:
        built.append(opt)
        return schedule(opt)

    buckets = [_optimizer_and_scheduler(SchedulerConfig(warmup_steps=2), 40) for _ in range(3)]
    rebuilt: dict[Any, Any] = {}
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")  # (tests/conftest.py enables the package's logs)
    try:
        for _, fresh in buckets:
            load_scheduler_state(fresh, saved, counted, rebuilt)
    finally:
        logger.remove(sink)
    assert len(built) == 1
    assert len(lines) == 1 and "from step 10" in lines[0], lines
    expected, expected_state = oracle(SchedulerConfig(warmup_steps=2), 40, 10)
    for opt, fresh in buckets:
        assert fresh.state_dict() == expected_state and opt.param_groups[0]["lr"] == expected[10]


def test_another_base_lr_follows_the_new_lr() -> None:
    """``optim.lr`` changed on resume: the schedule is the one of the new LR (the saved base LRs are the old)."""
    optimizer, scheduler = _optimizer_and_scheduler(NO_WARMUP, 10, lr=0.1)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    saved_optimizer, saved = copy.deepcopy(optimizer.state_dict()), scheduler.state_dict()
    new_optimizer, fresh = _optimizer_and_scheduler(NO_WARMUP, 10, lr=0.05)
    new_optimizer.load_state_dict(saved_optimizer)  # the old LR, as the checkpoint's optimizer state has it
    load_scheduler_state(fresh, saved, make_scheduler_fn(NO_WARMUP, 10), {})
    expected, expected_state = oracle(NO_WARMUP, 10, 3, lr=0.05)
    assert new_optimizer.param_groups[0]["lr"] == expected[3]
    assert fresh.state_dict() == expected_state


# -- through the launcher's worker: resume=RUN steps=more ------------------------------------------------------------
E2E_FIRST = SchedulerConfig(warmup_fraction=0.1)  # 6 steps: no warmup; 20 steps: 2 steps of warmup
PATHS = {  # each loads its schedule its own way: the engine's buckets, DDP's optimizer, the inner optimizer, FSDP2's
    "decentralized": {}, "allreduce": {"algorithm": "allreduce"},
    "diloco": {"algorithm": {"name": "diloco", "sync_every": 3}},  # an outer step in the first 6 steps (10: refused)
    "sharded": {"parallel": {"shard": 2}, "topology": {"local_world_size": 2}},
}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_resume_with_more_steps_through_the_worker(tmp_path: Path, path: str) -> None:
    """A finished 6-step run resumed with ``steps=20``: each record's ``train/lr`` is the 20-step schedule's."""
    common: dict[str, Any] = {"optim": {"name": "adamw", "lr": LR}, "eval_every": 0,
                              "scheduler": {"warmup_steps": 0, "warmup_fraction": 0.1},
                              "logger": {"log_every": 1, "consensus_every": 0}, **PATHS[path]}
    run_workers(train_on_cpu, 2, make_cfg(tmp_path / "first", steps=6, **common))
    resumed = make_cfg(tmp_path / "more", steps=20, resume=str(tmp_path / "first"), **common)
    assert run_workers(train_on_cpu, 2, resumed)[0]["resumed_from_step"] == 6
    expected, _ = oracle(E2E_FIRST, 20, 20)
    after = [r for r in records(tmp_path / "more") if "train/lr" in r]
    assert [r["step"] for r in after] == list(range(7, 21))
    for record in after:
        assert record["train/lr"] == expected[record["step"]], record["step"]
