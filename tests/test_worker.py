"""The worker's training loop against single-process oracles, in fork-started gloo workers (no torchrun).

``algorithm=decentralized``: the final model (the average of the workers' models) must equal the average of a replay
of decentralized training on the same batches (tests/replay.py); ``algorithm=allreduce``: one process taking the mean
loss over all workers' batches. Both also check the logged ``train/loss`` against the oracle's losses and the
reported accuracy against an evaluation of the oracle's model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decent_train.components.data import Datasets, build_datasets
from decent_train.components.models import build_model
from decent_train.components.optim import make_optim_fn, make_scheduler_fn
from decent_train.config import METRICS_FILE, MODEL_FILE, PRECISIONS, RESULT_FILE, TrainConfig
from decent_train.training import train

from .datafiles import write_token_files
from .distributed import run_workers
from .jobs import WORLD, make_cfg, records, train_on_cpu
from .replay import replay



def worker_batches(cfg: TrainConfig, data: Datasets) -> list[list[tuple[Tensor, Tensor]]]:
    """The micro-batches each rank draws, in order (the worker's own sharding, called here as the data source)."""
    count = cfg.steps * cfg.accum_steps
    streams = [data.train_batches(cfg.batch_size, r, WORLD, cfg.seed) for r in range(WORLD)]
    return [[next(stream) for _ in range(count)] for stream in streams]


def initial_model(cfg: TrainConfig, data: Datasets) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return build_model(cfg.model, data.input_shape, data.num_classes)


def autocast(cfg: TrainConfig) -> torch.autocast:
    return torch.autocast("cpu", dtype=PRECISIONS[cfg.precision], enabled=cfg.precision != "fp32")


def average_model(cfg: TrainConfig, data: Datasets, models: list[dict[str, Tensor]]) -> nn.Module:
    """The mean of the replayed workers' parameters and floating-point buffers (what the worker saves at the end)."""
    average = initial_model(cfg, data)
    with torch.no_grad():
        for name, value in [*average.named_parameters(), *average.named_buffers()]:
            stacked = torch.stack([m[name] for m in models])
            value.copy_(stacked.mean(0) if value.is_floating_point() else stacked[0])  # counters: equal on all
    return average


def accuracy(model: nn.Module, data: Datasets, cfg: TrainConfig) -> float:
    """Over the whole evaluation set (next-token accuracy for tokens), computed in one piece."""
    x, y = next(data.eval_batches(10**9, 0, 1))
    model.eval()
    with torch.no_grad(), autocast(cfg):
        return (model(x).argmax(-1) == y).double().mean().item()


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records(run_dir)}


def expected_window_losses(losses: dict[tuple[int, int, int], float], cfg: TrainConfig) -> dict[int, float]:
    """Mean loss over all workers and micro-batches since the previous record, for each logged step."""
    logged = sorted({s for s in range(1, cfg.steps + 1) if s % cfg.logger.log_every == 0 or s % cfg.eval_every == 0} | {cfg.steps})
    out, previous = {}, 0
    for step in logged:
        window = [v for (rank, s, micro), v in losses.items() if previous <= s < step]
        out[step] = sum(window) / len(window)
        previous = step
    return out


def check_run(
    cfg: TrainConfig, oracle_model: nn.Module, losses: dict, data: Datasets, saved_model: nn.Module | None = None
) -> None:
    """``oracle_model`` is what is evaluated (and saved, unless ``saved_model`` is given)."""
    run_dir = Path(cfg.run.output_dir)
    saved = torch.load(run_dir / MODEL_FILE)
    for name, value in (saved_model or oracle_model).state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=2e-5, msg=f"final model differs at {name}")
    logged = logged_losses(run_dir)
    for step, want in expected_window_losses(losses, cfg).items():
        assert logged[step] == pytest.approx(want, rel=1e-5), f"train/loss at step {step}"
    result = json.loads((run_dir / RESULT_FILE).read_text())
    assert result["eval/accuracy"] == pytest.approx(accuracy(oracle_model, data, cfg), abs=1e-12)
    assert result["steps"] == cfg.steps and result["samples"] == cfg.steps * WORLD * cfg.batch_size * cfg.accum_steps


def gpt_on_tokens(tmp_path: Path) -> dict[str, Any]:
    write_token_files(tmp_path / "tokens", n_train=4000, n_val=400, vocab=48)
    return dict(
        model={"name": "gpt2", "layers": 2, "heads": 2, "width": 16},
        dataset={"name": "tokens", "root": str(tmp_path / "tokens"), "context_length": 12, "vocab_size": 48},
        batch_size=4,
    )


# name: the config overrides of a decentralized run that must match the replay
RUNS = {
    "ring": lambda tmp: {"topology": {"name": "ring"}},
    "complete": lambda tmp: {"topology": {"name": "complete"}},
    "bf16_label_smoothing": lambda tmp: {"precision": "bf16", "label_smoothing": 0.1},
    "fp16_scaler_and_clipping": lambda tmp: {"precision": "fp16", "grad_clip_norm": 0.3},
    "gpt2_tied_on_tokens": gpt_on_tokens,
    # all-reduce -> ring -> all-reduce in the engine, a global average every 3 steps (phase boundaries at records)
    "phases": lambda tmp: {
        "phases": [{"algorithm": "allreduce", "steps": 2}, {"topology": "ring", "steps": 2}, {"algorithm": "allreduce"}],
        "global_avg_every": 3,
    },
    "gossip_without_final_average": lambda tmp: {"final_average": False},  # rank 0's own model is saved
}


@pytest.mark.parametrize("run", list(RUNS))
def test_decentralized_run_matches_replay(tmp_path: Path, run: str) -> None:
    cfg = make_cfg(tmp_path, **RUNS[run](tmp_path))
    topology = cfg.topology.name
    run_workers(train_on_cpu, WORLD, cfg)

    data = build_datasets(cfg.dataset)
    batches = worker_batches(cfg, data)
    losses: dict[tuple[int, int, int], float] = {}

    def loss(model: nn.Module, rank: int, step: int, micro: int) -> Tensor:
        x, y = batches[rank][step * cfg.accum_steps + micro]
        with autocast(cfg):
            logits = model(x)
        value = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), label_smoothing=cfg.label_smoothing)
        losses[(rank, step, micro)] = value.item()
        return value / cfg.accum_steps

    from decent_train import build_topology

    phases = {start: None if mode == "allreduce" else build_topology(mode, WORLD, WORLD)
              for start, mode in cfg.phase_starts()}
    models = replay(
        build_topology(topology, WORLD, WORLD),
        cfg.steps,
        optim_fn=make_optim_fn(cfg.optim),
        lr_scheduler_fn=make_scheduler_fn(cfg.scheduler, cfg.steps),
        model_fn=lambda _: initial_model(cfg, data),
        loss=loss,
        micro_batches=cfg.accum_steps,
        grad_clip_norm=cfg.grad_clip_norm,
        phases=phases,
        global_avg_every=cfg.global_avg_every,
    )
    average = average_model(cfg, data, models)  # evaluated; saved too unless final_average=false saves rank 0's own
    check_run(cfg, average, losses, data, saved_model=None if cfg.final_average else average_model(cfg, data, models[:1]))
    if cfg.phases:  # the records say which phase they close; every phase ends with a record
        logged = {r["step"]: (r["phase"], r["phase/name"]) for r in records(tmp_path)}
        assert logged == {2: (0, "allreduce"), 3: (1, "ring"), 4: (1, "ring"), 6: (2, "allreduce")}  # 3: eval_every


def test_allreduce_run_matches_single_process(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, algorithm="allreduce", optim={"name": "adamw"}, grad_clip_norm=0.5)
    run_workers(train_on_cpu, WORLD, cfg)

    data = build_datasets(cfg.dataset)
    batches = worker_batches(cfg, data)
    model = initial_model(cfg, data)
    optimizer = make_optim_fn(cfg.optim)(list(model.named_parameters()))
    scheduler = make_scheduler_fn(cfg.scheduler, cfg.steps)(optimizer)
    losses = {}
    for step in range(cfg.steps):
        for micro in range(cfg.accum_steps):
            for rank in range(WORLD):  # DDP averages the gradients: the mean of the ranks' losses
                x, y = batches[rank][step * cfg.accum_steps + micro]
                value = F.cross_entropy(model(x), y)
                losses[(rank, step, micro)] = value.item()
                (value / (WORLD * cfg.accum_steps)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    check_run(cfg, model, losses, data)


def _train_recording_layout(rank: int, world: int, cfg: TrainConfig) -> dict[str, bool]:
    seen: dict[str, bool] = {}

    def on_record(record: dict[str, Any], model: nn.Module) -> None:
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d) and m.in_channels > 1)  # else NCHW = NHWC
        seen["channels_last"] = conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
        seen["compiled"] = getattr(model, "_compiled_call_impl", None) is not None

    train(cfg, Path(cfg.run.output_dir), torch.device("cpu"), on_record=on_record)
    return seen


@pytest.mark.parametrize("compile", [False, True])
def test_channels_last_and_compile_train_the_same_model(tmp_path: Path, compile: bool) -> None:
    """A CNN in channels_last (and compiled) ends where the replay of the plain model ends."""
    cfg = make_cfg(tmp_path, model={"name": "cnn", "channels": [4, 8]}, channels_last=True, compile=compile, steps=4)
    seen = run_workers(_train_recording_layout, WORLD, cfg, timeout=600)
    assert all(s == {"channels_last": True, "compiled": compile} for s in seen)

    data = build_datasets(cfg.dataset)
    batches = worker_batches(cfg, data)
    losses: dict[tuple[int, int, int], float] = {}

    def loss(model: nn.Module, rank: int, step: int, micro: int) -> Tensor:
        x, y = batches[rank][step * cfg.accum_steps + micro]
        value = F.cross_entropy(model(x), y)
        losses[(rank, step, micro)] = value.item()
        return value / cfg.accum_steps

    from decent_train import build_topology

    models = replay(
        build_topology(cfg.topology.name, WORLD, WORLD),
        cfg.steps,
        optim_fn=make_optim_fn(cfg.optim),
        lr_scheduler_fn=make_scheduler_fn(cfg.scheduler, cfg.steps),
        model_fn=lambda _: initial_model(cfg, data),
        loss=loss,
        micro_batches=cfg.accum_steps,
    )
    average = average_model(cfg, data, models)
    check_run(cfg, average, losses, data)


def test_phases_longer_than_an_epoch_based_run_fail_before_training(tmp_path: Path) -> None:
    """With epochs, the step count is known only in the worker: it refuses a last phase that would never run."""
    from .distributed import WorkerError

    cfg = make_cfg(tmp_path, steps=0, epochs=0.1, phases=[{"algorithm": "allreduce", "steps": 10_000}, {}])
    with pytest.raises(WorkerError, match="phases before the last take 10000 steps, but the run has 3 "):
        run_workers(train_on_cpu, WORLD, cfg)
    assert not (tmp_path / METRICS_FILE).exists()
