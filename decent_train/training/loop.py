"""The training loop: steps, and at each step the recorder, the evaluator and the checkpointer say whether it is
theirs. Each owns its state; the loop only orders them."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from loguru import logger
from torch import Tensor, nn

from decent_train.components.checkpoint import CHECKPOINTS
from decent_train.components.metrics import MetricLogger
from decent_train.engine.comm import ExchangeError
from decent_train.training.checkpointer import Checkpointer
from decent_train.training.evaluator import Evaluator
from decent_train.training.forward import cross_entropy
from decent_train.training.job import Job
from decent_train.training.live_changes import LiveTraining
from decent_train.training.recorder import Recorder
from decent_train.training.stop import REQUEST, Stop, TrainingStopped

OnRecord = Callable[[dict[str, Any], nn.Module], None]
T = TypeVar("T")


def train_loop(
    job: Job, metrics: MetricLogger, on_record: OnRecord | None, live: LiveTraining | None = None
) -> dict[str, Any]:
    """Train from ``job.start_step`` to ``job.total_steps``; the run's result (accuracy, losses, throughput).
    ``live``: the members may change at a step boundary (``fault_tolerance=live``)."""
    algo = job.algo
    recorder, evaluator, checkpointer = Recorder(job, metrics), Evaluator(job), Checkpointer(job)
    batches = _batches(job, recorder)
    joined = live is not None and live.joined  # it joined after start_step: that step's records are still to come
    stopped: Stop | None = None
    for step in range(job.start_step + (0 if joined else 1), job.total_steps + 1):
        evaluate_now = evaluator.should_evaluate(step)
        record_now = evaluate_now or recorder.should_record(step)
        save_now = checkpointer.should_save(step)
        stop_signal = 0
        if step > job.start_step:
            _train_step(job, step, batches, recorder)
            if live is not None and live.change_at(step, needs_all=record_now or save_now):
                live.change(step)
        try:
            with live.record_step() if live is not None and (record_now or save_now) else contextlib.nullcontext():
                if record_now or save_now:
                    stop_signal = recorder.check_finite(REQUEST.number)  # every rank: the same answer
                if record_now:
                    record = recorder.measure(step)
                    if on_record is not None:
                        on_record(record, algo.net)
                    if evaluate_now:
                        logger.debug(f"step {step}: evaluating")
                        with recorder.paused():
                            record.update(_despite_changes(live, step, evaluator.evaluate))
                    recorder.log(record)
                if save_now:  # after the step's record: a run resumed here logs from the next step on
                    with recorder.paused():
                        _despite_changes(live, step, lambda: checkpointer.save(step))
        except ExchangeError as error:
            if live is None:
                raise
            # A member died inside one of these collectives (some members may have finished it): all go on, and
            # change at the next record step.
            logger.warning(f"step {step}: {error}; the rest of this step's records is skipped")
        if live is not None and live.changed_at == step:
            batches = _batches(job, recorder)  # this worker's share over the new members
        if stop_signal and step < job.total_steps:
            stopped = _stop_at(job, step, stop_signal, checkpointer, recorder, saved=save_now)
            break
    recorder.close()
    if stopped is not None:
        raise TrainingStopped(stopped)
    return _result(job, recorder, evaluator)


def _stop_at(
    job: Job, step: int, signum: int, checkpointer: Checkpointer, recorder: Recorder, saved: bool
) -> Stop:
    """A worker received a stop signal (training/stop.py): every worker saves its state at ``step`` (unless this
    step's periodic checkpoint did) and stops."""
    with recorder.paused():
        path = job.run_dir / CHECKPOINTS / f"step_{step:08d}" if saved else checkpointer.save(step)
    name = signal.Signals(signum).name
    logger.debug(f"step {step}: stopping on {name}, checkpoint {path}")
    return Stop(step, job.total_steps, name, str(path))


def _despite_changes(live: LiveTraining | None, step: int, work: Callable[[], T]) -> T:
    """``work()``; with live membership, again after a change if a member died while it ran."""
    return work() if live is None else live.despite_changes(step, work)


def _train_step(job: Job, step: int, batches: Iterator[tuple[Tensor, Tensor]], recorder: Recorder) -> None:
    cfg, algo, precision = job.cfg, job.algo, job.precision
    if algo.begin_step(step - 1):
        logger.info(f"step {step}: phase {algo.phase} ({algo.phase_name}) begins")
    for micro in range(cfg.accum_steps):
        x, y = next(batches)
        with contextlib.nullcontext() if micro == cfg.accum_steps - 1 else algo.no_sync():
            with precision.autocast():
                loss = cross_entropy(algo.model(x), y, label_smoothing=cfg.label_smoothing)
            precision.scaler.scale(loss / cfg.accum_steps).backward()
        recorder.add_loss(loss, step)
    algo.step()
    recorder.end_step()


def _batches(job: Job, recorder: Recorder) -> Iterator[tuple[Tensor, Tensor]]:
    """This worker's share of the training stream from ``job.data_start`` on (again after a membership change)."""
    batches = job.data.device_train_batches(
        job.batch_size, dist.get_rank(), dist.get_world_size(), job.cfg.seed, start=job.data_start,
        device=job.device, channels_last=job.cfg.channels_last,
    )
    return recorder.timed(batches)


def _result(job: Job, recorder: Recorder, evaluator: Evaluator) -> dict[str, Any]:
    """Average the workers' models if asked; what ``result.json`` reports of the training."""
    record, train_seconds = recorder.last, recorder.train_seconds
    if not record:  # resumed from the final checkpoint: only the evaluation of the average is left (train.py then
        record = {"train/loss": None, **evaluator.evaluate()}  # keeps the training's numbers of an earlier result)
        train_seconds = None
    if job.cfg.final_average:
        job.algo.average()  # the final model is the average of the workers' models
    samples_per_step, world = recorder.samples_per_step, dist.get_world_size()
    trained = (job.total_steps - job.start_step) * samples_per_step * world  # in this run (after a resume: since it)
    return {
        "eval/accuracy": record["eval/accuracy"],
        "eval/loss": record["eval/loss"],
        "train/loss": record["train/loss"],
        "steps": job.total_steps,
        "resumed_from_step": job.start_step,
        "samples": job.total_steps * samples_per_step * world,
        "train_time_s": train_seconds,
        "throughput/samples_per_s": trained / train_seconds if train_seconds else None,
    }
