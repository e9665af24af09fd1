"""The metrics recorder: timing windows, loss sums, the workers' agreement that the loss is finite, and the record.

Every rank measures; rank 0's ``MetricLogger`` writes. A record closes a window: what it reports (throughput, step
and data time, time blocked on peers) is over the steps since the previous one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from decent_train.components.checkpoint import complete_checkpoints
from decent_train.components.metrics import MetricLogger, held_bytes, optimizer_state_tensors, peak_memory_bytes
from decent_train.config import DIVERGED_FILE
from decent_train.engine import reconfigure
from decent_train.engine.comm import peers_must_answer, run_collective
from decent_train.training.job import Job

T = TypeVar("T")


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite: training stops, the checkpoints before it are kept."""


class Recorder:
    """Owns what a record measures between records; the loop tells it what happened and asks when to record."""

    def __init__(self, job: Job, metrics: MetricLogger) -> None:
        cfg, algo, device = job.cfg, job.algo, job.device
        self.job, self.metrics = job, metrics
        self.consensus = algo.consensus_probe(cfg.logger.consensus_samples, cfg.seed)
        self.params_bytes = held_bytes(list(algo.net.parameters()))  # this rank's (its shards): fixed
        self.samples_per_step = job.batch_size * cfg.accum_steps  # per worker
        self.phase_ends = {start for start, _ in cfg.phase_starts()[1:]} | {job.total_steps}  # a record closes each
        self.bar = tqdm(
            total=job.total_steps, initial=job.start_step, unit="step",
            disable=dist.get_rank() != 0 or not cfg.logger.progress_bar, dynamic_ncols=True,
        )
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no host sync per step
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)  # the first NaN/inf loss's; 0: none
        self.micro_batches, self.data_seconds, self.comm_start = 0, 0.0, algo.comm_wait_seconds() or 0.0
        self.late_start = algo.late_buckets() or 0
        self.window_start = self.train_start = time.perf_counter()
        self.train_seconds = 0.0  # summed over the windows: without evaluations and checkpoints
        self.last: dict[str, Any] = {}  # the latest record; empty until this run records

    def timed(self, batches: Iterator[T]) -> Iterator[T]:
        """``batches``, with the time spent waiting for each counted as data time."""
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.data_seconds += time.perf_counter() - start
            yield batch

    def add_loss(self, loss: torch.Tensor, step: int) -> None:
        """A micro-batch of ``step`` was trained with this (unscaled) loss."""
        loss = loss.detach()
        self.loss_sum += loss
        self.first_bad_step = torch.where((self.first_bad_step == 0) & ~torch.isfinite(loss), step, self.first_bad_step)
        self.micro_batches += 1

    def end_step(self) -> None:
        self.bar.update()

    def _consensus_now(self, step: int) -> bool:
        every = self.job.cfg.logger.consensus_every
        return every > 0 and step % every == 0

    def should_record(self, step: int) -> bool:
        """Every ``logger.log_every`` steps, when the consensus distance is measured, and at the end of each phase
        (an evaluation records too: the loop asks the evaluator)."""
        return step % self.job.cfg.logger.log_every == 0 or self._consensus_now(step) or step in self.phase_ends

    def check_finite(self, stop_signal: int = 0) -> int:
        """Stop on every rank if any rank's loss was NaN or infinite since the start: never log or save a diverged
        model as if it were fine. Every rank calls it at the same steps. ``stop_signal``: this rank's (0: none); the
        largest of any rank's, in the same gather (training/stop.py: every rank stops at the same step)."""
        return _check_finite(self.first_bad_step, self.job.run_dir, stop_signal)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """What runs inside (evaluation, checkpoints) is not training time: the window leaves it out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - start

    def measure(self, step: int) -> dict[str, Any]:
        """Close the window at ``step``: the record of every worker's measurements (one gather). Every rank calls it."""
        job, cfg, algo, device = self.job, self.job.cfg, self.job.algo, self.job.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the window's time includes its queued work
        now = time.perf_counter()
        elapsed = now - self.window_start
        comm_seconds = (algo.comm_wait_seconds() or 0.0) - self.comm_start
        late_buckets = (algo.late_buckets() or 0) - self.late_start
        stats = gather(  # one row per worker
            [self.loss_sum, self.micro_batches, elapsed, self.data_seconds, comm_seconds, peak_memory_bytes(device),
             algo.bytes_per_step(), self.params_bytes,
             held_bytes(optimizer_state_tensors(algo.optimizers())), late_buckets],
            device,
        )
        # The record's own cost (the gather above, the consensus all-reduce, the sinks) is training time: it counts in
        # the next window, so throughput shows what measuring costs.
        self.window_start = now
        self.train_seconds += elapsed
        loss_total, micro_total, elapsed_w, data_w, comm_w, memory_w, bytes_w, params_w, optim_w, late_w = stats.T
        trained = micro_total > 0  # all but a worker that joined at this step (live membership)
        steps_in_window = micro_total.max().item() / cfg.accum_steps
        per_worker_loss = loss_total[trained] / micro_total[trained]
        record = {
            "step": step,
            "epoch": step / job.steps_per_epoch,
            "phase": algo.phase,
            "phase/name": algo.phase_name,
            "train/loss": (loss_total.sum() / micro_total.sum()).item(),
            # The spread over workers: on heterogeneous shards (dataset.partition) each fits its own labels.
            "train/loss_min_worker": per_worker_loss.min().item(),
            "train/loss_max_worker": per_worker_loss.max().item(),
            "train/lr": algo.lr(),
            "throughput/samples_per_s": (
                dist.get_world_size() * steps_in_window * self.samples_per_step / elapsed_w.max().item()
            ),
            # The slowest worker at its own pace (time blocked on its neighbours removed): exposes a straggler, whom
            # the others wait for.
            "throughput/samples_per_s_min_worker": (
                steps_in_window * self.samples_per_step / (elapsed_w - comm_w).max().item()
            ),
            "time/step_ms": 1000 * elapsed_w.mean().item() / steps_in_window,
            "time/data_ms": 1000 * data_w.mean().item() / steps_in_window,
            "comm/bytes_per_step": bytes_w.mean().item(),
            "memory/peak_gib": memory_w.max().item() / 2**30,
            # What one rank holds (a sharded model: its shards), the largest over the ranks.
            "memory/params_mib": params_w.max().item() / 2**20,
            "memory/optimizer_mib": optim_w.max().item() / 2**20,
            "world/members": dist.get_world_size(),
            "time/elapsed_s": time.perf_counter() - self.train_start,
        }
        if cfg.dataset.is_tokens:
            record["throughput/tokens_per_s"] = record["throughput/samples_per_s"] * cfg.dataset.context_length
        if algo.comm_wait_seconds() is not None:
            record["time/comm_wait_ms"] = 1000 * comm_w.mean().item() / steps_in_window
        if algo.late_buckets() is not None:  # buckets held to the end of backward by a late gradient (ddp.py's order)
            record["engine/late_buckets_per_step"] = late_w.mean().item() / steps_in_window
        record.update(algo.metrics())
        if self._consensus_now(step):
            record["consensus/distance"], record["consensus/relative"] = self.consensus.measure()
        self.last = record
        return record

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (rank 0) and start the next window's sums."""
        self.metrics.log(record)
        self.bar.set_postfix(
            {"loss": f"{record['train/loss']:.4f}", "samples/s": f"{record['throughput/samples_per_s']:.0f}"}
            | ({"acc": f"{record['eval/accuracy']:.4f}"} if "eval/accuracy" in record else {}),
            refresh=False,
        )
        self.loss_sum.zero_()
        self.micro_batches, self.data_seconds, self.comm_start = 0, 0.0, self.job.algo.comm_wait_seconds() or 0.0
        self.late_start = self.job.algo.late_buckets() or 0

    def close(self) -> None:
        self.bar.close()


def gather(values: list[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """Every worker's values, one row per rank (a few numbers: cheap); over the default group (on the CPU beside a
    data group: ``reconfigure.control_device``)."""
    device = reconfigure.control_device(device)
    row = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    rows = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64, device=device)
    rows[dist.get_rank()] = row
    with peers_must_answer("the gather of the workers' statistics"):
        run_collective(dist.all_reduce, rows)  # a sum of rows that are zero but one's: the gather
    return rows.cpu()


def _check_finite(first_bad_step: torch.Tensor, run_dir: Path, stop_signal: int = 0) -> int:
    """Stop on every rank if any rank's loss was NaN or infinite since the start (``first_bad_step`` > 0); the
    largest ``stop_signal`` of any rank."""
    rows = gather([first_bad_step, stop_signal], first_bad_step.device)
    steps = rows[:, 0]
    if steps.max() > 0:
        step = int(steps[steps > 0].min())
        rank = int((steps == step).nonzero()[0])
        good = complete_checkpoints(run_dir)
        kept = f"the last good checkpoint is {good[0].path}" if good else "no checkpoint was written before it"
        why = f"train/loss is NaN or infinite from step {step} on (rank {rank}); stopped: {kept}"
        if dist.get_rank() == 0:
            (run_dir / DIVERGED_FILE).write_text(why + "\n")
        raise NonFiniteLoss(why)
    return int(rows[:, 1].max())


def refuse_to_diverge_again(run_dir: Path) -> None:
    """Workers that torchrun's agent restarts after a NaN/inf loss fail at once: training on from the same
    checkpoint on the same data would diverge at the same step again (once per ``launch.max_restarts``)."""
    diverged = run_dir / DIVERGED_FILE
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        if dist.get_rank() == 0:
            diverged.unlink(missing_ok=True)  # left by an earlier launch into this directory
    elif diverged.exists():
        raise NonFiniteLoss(f"{diverged.read_text().strip()} (in an earlier attempt; restarts do not train again)")
