"""The worker: ``python -m decent_train.worker RUN_DIR/resolved_config.yaml``, one process per rank under torchrun.

It never runs Hydra: it reads the resolved config the launcher wrote, joins the process group, trains, evaluates the
average of the workers' models, and (rank 0) writes metrics.jsonl, result.json and the averaged model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loguru import logger
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from decent_train.components.data import build_datasets, eval_batches, micro_batches_per_epoch, train_batches
from decent_train.components.metrics import MetricLogger, setup_worker_logging
from decent_train.components.models import build_model
from decent_train.components.optim import make_optim_fn, make_scheduler_fn
from decent_train.config import TrainConfig, load_config
from decent_train.engine.ddp import DecentralizedDataParallel

MODEL_FILE = "model.pt"
RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"


class Decentralized:
    """``algorithm=decentralized``: the engine steps inside backward and gossips with the topology's neighbours."""

    def __init__(self, net: nn.Module, cfg: TrainConfig, total_steps: int):
        self.engine = DecentralizedDataParallel(
            net,
            optim_fn=make_optim_fn(cfg.optim),
            lr_scheduler_fn=make_scheduler_fn(cfg.scheduler, total_steps),
            topology=cfg.topology.name,
            grad_clip_norm=cfg.grad_clip_norm,
            bucket_size_in_mb=cfg.bucket_size_mb,
            local_world_size=cfg.topology.local_world_size,  # None: torchrun's LOCAL_WORLD_SIZE
            sync_buffer_in_global_avg=True,  # BatchNorm statistics are averaged with the parameters for evaluation
        )
        self.model, self.net = self.engine, net

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.no_sync()

    def step(self) -> None:
        """Nothing left to do: each bucket stepped during backward."""

    def lr(self) -> float:
        return self.engine.get_lr()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The global average of the workers' models, for evaluation; the local models come back afterwards."""
        self.engine.global_avg(will_revert=True)
        try:
            yield
        finally:
            self.engine.revert_global_avg()

    def average(self) -> None:
        """Replace every worker's model by the global average for good (the end of training)."""
        self.engine.global_avg(will_revert=False)


class AllReduce:
    """``algorithm=allreduce``: torch DistributedDataParallel with the same model, data, optimizer and schedule."""

    def __init__(self, net: nn.Module, cfg: TrainConfig, total_steps: int):
        device_ids = [net_device(net)] if net_device(net).type == "cuda" else None
        self.model = DistributedDataParallel(net, device_ids=device_ids, bucket_cap_mb=cfg.bucket_size_mb)
        self.net = net
        self.optimizer = make_optim_fn(cfg.optim)(list(net.named_parameters()))
        self.scheduler = make_scheduler_fn(cfg.scheduler, total_steps)(self.optimizer)
        self.grad_clip_norm = cfg.grad_clip_norm

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync()

    def step(self) -> None:
        if self.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def averaged(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # all-reduce keeps the workers' models equal

    def average(self) -> None:
        pass


def net_device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device


@torch.no_grad()
def evaluate(net: nn.Module, cfg: TrainConfig, test: Any, device: torch.device) -> dict[str, float]:
    """Loss and accuracy on the whole test set; each worker evaluates a disjoint slice and the sums are reduced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for x, y in eval_batches(test, rank, world, cfg.eval_batch_size):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = net(x)
        sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
        sums[1] += (logits.argmax(dim=1) == y).sum()
        sums[2] += len(y)
    dist.all_reduce(sums)
    net.train(was_training)
    loss, correct, count = sums.tolist()
    return {"eval/loss": loss / count, "eval/accuracy": correct / count}


def train(cfg: TrainConfig, run_dir: Path, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = build_datasets(cfg.dataset)
    torch.manual_seed(cfg.seed)  # the same initial model on every worker
    net = build_model(cfg.model, data.input_shape, data.num_classes).to(device)
    torch.manual_seed(cfg.seed + rank)  # dropout and any other randomness differ per worker

    steps_per_epoch = micro_batches_per_epoch(data.train, cfg.batch_size, world) // cfg.accum_steps
    total_steps = cfg.steps or math.ceil(cfg.epochs * max(1, steps_per_epoch))
    algo = Decentralized(net, cfg, total_steps) if cfg.algorithm == "decentralized" else AllReduce(net, cfg, total_steps)
    samples_per_step = world * cfg.batch_size * cfg.accum_steps
    batches = train_batches(data.train, cfg.batch_size, rank, world, cfg.seed)
    metrics = MetricLogger(run_dir / METRICS_FILE if rank == 0 else None)
    logger.info(
        f"{cfg.algorithm}"
        + (f", {algo.engine.topology.describe()}" if isinstance(algo, Decentralized) else f", {world} workers")
        + f"; {sum(p.numel() for p in net.parameters()):,} parameters; {len(data.train)} training samples; "
        f"{total_steps} steps of {samples_per_step} samples ({total_steps / max(1, steps_per_epoch):.1f} epochs)"
    )

    bar = tqdm(total=total_steps, unit="step", disable=rank != 0 or not cfg.logger.progress_bar, dynamic_ncols=True)
    window = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, micro-batches since the last record
    window_start = train_start = time.perf_counter()
    train_seconds = 0.0
    record: dict[str, Any] = {}
    for step in range(1, total_steps + 1):
        for micro in range(cfg.accum_steps):
            x, y = (t.to(device, non_blocking=True) for t in next(batches))
            last = micro == cfg.accum_steps - 1
            with contextlib.nullcontext() if last else algo.no_sync():
                loss = F.cross_entropy(algo.model(x), y)
                (loss / cfg.accum_steps).backward()
            window[0] += loss.detach().double()  # no host sync per step
            window[1] += 1
        algo.step()
        bar.update()

        evaluate_now = step == total_steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
        if step % cfg.logger.log_every == 0 or evaluate_now:
            dist.all_reduce(window)
            loss_sum, micro_batches = window.tolist()  # waits for the device: the window's time is complete
            elapsed = time.perf_counter() - window_start
            train_seconds += elapsed
            steps_in_window = micro_batches / world / cfg.accum_steps
            record = {
                "step": step,
                "epoch": step / max(1, steps_per_epoch),
                "train/loss": loss_sum / micro_batches,
                "train/lr": algo.lr(),
                "throughput/samples_per_s": steps_in_window * samples_per_step / elapsed,
                "time/step_ms": 1000 * elapsed / steps_in_window,
                "time/elapsed_s": time.perf_counter() - train_start,
            }
            if evaluate_now:
                if step == total_steps:
                    algo.average()  # the final model is the average of the workers' models
                with algo.averaged():
                    record.update(evaluate(algo.net, cfg, data.test, device))
            metrics.log(record)
            bar.set_postfix(
                {"loss": f"{record['train/loss']:.4f}", "samples/s": f"{record['throughput/samples_per_s']:.0f}"}
                | ({"acc": f"{record['eval/accuracy']:.4f}"} if "eval/accuracy" in record else {}),
                refresh=False,
            )
            window.zero_()
            window_start = time.perf_counter()
    bar.close()
    metrics.close()

    result = {
        "eval/accuracy": record["eval/accuracy"],
        "eval/loss": record["eval/loss"],
        "train/loss": record["train/loss"],
        "steps": total_steps,
        "samples": total_steps * samples_per_step,
        "train_time_s": train_seconds,
        "throughput/samples_per_s": total_steps * samples_per_step / train_seconds,
        "world_size": world,
        "algorithm": cfg.algorithm,
        "topology": cfg.topology.name if cfg.algorithm == "decentralized" else None,
        "model_path": str(run_dir / MODEL_FILE),
    }
    if rank == 0:
        torch.save({k: v.cpu() for k, v in algo.net.state_dict().items()}, run_dir / MODEL_FILE)
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
        logger.info(
            f"done: eval/accuracy {result['eval/accuracy']:.4f}, {result['throughput/samples_per_s']:.0f} samples/s"
        )
    return result


def init_distributed(device_kind: str) -> torch.device:
    """Join the process group torchrun describes: NCCL and one GPU per local rank on CUDA, gloo on CPU."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device=cuda but this worker sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


@record
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m decent_train.worker RUN_DIR/resolved_config.yaml   (under torchrun)")
    config_path = Path(args[0]).resolve()
    cfg = load_config(config_path)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else config_path.parent
    device = init_distributed(cfg.launch.device)
    setup_worker_logging(run_dir, dist.get_rank(), cfg.logger)
    try:
        train(cfg, run_dir, device)
        dist.barrier()  # leave together: a peer tearing down gloo while others still talk to it aborts them
    except Exception as error:
        # The traceback goes to this rank's log and to the error file the launcher reports from; not to the console
        # of every rank.
        logger.opt(exception=error).debug(f"rank {dist.get_rank()} failed")
        ErrorHandler().record_exception(error)
        sys.exit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
