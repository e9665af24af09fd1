"""Stopping on a signal: SIGINT (Ctrl-C), SIGTERM (SLURM's preemption, ``scancel``, time limit) and SIGUSR1 (SLURM's
``--signal``, before the time limit) make every worker stop at the same step with a checkpoint there.

The handler only notes the signal: the step in progress finishes. The workers agree on the step to stop at in the
gather every record step already runs (``Recorder.check_finite``: the first NaN loss's step, and the signal, one
column each), so stopping costs no collective and no host synchronisation beyond what a record costs; a worker that
saw no signal learns of its peers' there. The stop comes at most ``logger.log_every`` steps after the signal (the
workers may see it at different steps: torchrun's agent forwards it to one worker after another, and on several
nodes each agent receives it at its own time). A second SIGINT ends the worker at once, without a checkpoint.

decent-train's launcher passes SIGINT, SIGTERM and SIGUSR1 on to its workers as SIGUSR1 (see :func:`install`).

After the checkpoint, rank 0 writes ``RUN_DIR/stopped.json`` (the step, the signal, the checkpoint) and every worker
exits 0, so that an agent that saw no signal (another node's) does not take the stop for a failure and restart
them; the launcher reads the file and exits with :data:`EXIT_STOPPED`.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

STOP_FILE = "stopped.json"
EXIT_STOPPED = 75  # sysexits.h EX_TEMPFAIL: stopped with a checkpoint, resume= continues (scripts/slurm_train.sbatch)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
FORWARDED = signal.SIGUSR1  # what decent-train's launcher passes on to its workers, whichever of these it received
# In a SLURM job also SIGUSR2: submitit's (hydra/launcher=slurm) before the time limit and at a preemption, which
# SLURM sends to every process of the job step, as it does SIGTERM
SLURM_STOP_SIGNALS = (*STOP_SIGNALS, signal.SIGUSR2)
AGENT_PID_ENV = "DECENT_TRAIN_AGENT_PID"  # set by decent-train's launcher for its workers (runtime.die_with_agent)
# Beside the resolved config: the launcher's stop signal, for workers it could not pass it on to (not started yet).
REQUEST_FILE = "stop_requested"


class _Request:
    """The first stop signal this process received (signal handlers are per process: one instance)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    def install(self, signals: tuple[signal.Signals, ...]) -> None:
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.signal is not None and sig == signal.SIGINT:  # a second Ctrl-C: at once, no checkpoint
            os._exit(128 + signum)
        if self.signal is None:  # a repeated SIGTERM (SLURM signals both the agent and its workers) changes nothing
            self.signal = sig

    @property
    def number(self) -> int:
        """What this worker contributes to the agreement: the signal's number, 0 for none."""
        return 0 if self.signal is None else int(self.signal)


REQUEST = _Request()


def install(request_file: Path | None = None) -> None:
    """Catch the stop signals in this worker (the main thread, before training); then take the launcher's stop if
    ``request_file`` says it received one before this worker could be signalled (a Ctrl-C while torchrun starts the
    workers): it writes the file before passing the signal on, and this reads it after the handler is set, so a
    worker misses neither.

    Under decent-train's launcher only :data:`FORWARDED` (and SIGINT): torchrun's agent stops the workers with
    SIGTERM when one failed, to restart them or end the run, and they must go at once, not finish a step with a peer
    that is gone. Under a plain torchrun (scripts/slurm_train.sbatch), and under decent-train's launcher in a SLURM
    job (a sweep's job, ``srun decent-train``), all of :func:`stop_signals`: SLURM may send SIGTERM to every process
    of the job step, the workers too, which would otherwise die of it before the launcher's stop reaches them; there an
    agent's restart waits for the others until their collective with the lost peer fails (or torchrun's
    ``--shutdown-timeout``)."""
    under_launcher = AGENT_PID_ENV in os.environ and "SLURM_JOB_ID" not in os.environ
    REQUEST.install((signal.SIGINT, FORWARDED) if under_launcher else stop_signals())
    if request_file is not None and request_file.exists() and REQUEST.signal is None:
        REQUEST.signal = FORWARDED


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a run with a checkpoint in this process: :data:`STOP_SIGNALS`, in a SLURM job
    :data:`SLURM_STOP_SIGNALS`."""
    return SLURM_STOP_SIGNALS if "SLURM_JOB_ID" in os.environ else STOP_SIGNALS


@dataclass
class Stop:
    """Where the run stopped: ``RUN_DIR/stopped.json``."""

    step: int
    total_steps: int
    signal: str
    checkpoint: str

    def write(self, run_dir: Path) -> None:
        partial = run_dir / f"{STOP_FILE}.partial"
        partial.write_text(json.dumps(asdict(self)) + "\n")
        os.replace(partial, run_dir / STOP_FILE)

    @classmethod
    def read(cls, run_dir: Path) -> Stop | None:
        try:
            return cls(**json.loads((run_dir / STOP_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


class TrainingStopped(Exception):
    """Every worker stopped at ``stop.step`` on a signal, with a checkpoint there."""

    def __init__(self, stop: Stop) -> None:
        super().__init__(f"stopped by {stop.signal} at step {stop.step} of {stop.total_steps}")
        self.stop = stop
