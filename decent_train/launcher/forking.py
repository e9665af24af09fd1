"""The process the workers are forked from (decent_train/forkserver.py), started in the command's first milliseconds
(cli.py) when the command looks like it trains here: its seconds of imports (torch, torch._dynamo, the training code)
then run on another core while the launcher imports torch and composes the config, not after them
(scripts/BENCHMARKS.md, "The forkserver started with the command"). Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

FORKSERVER_MODULE = "decent_train.forkserver"  # what the process the workers are forked from imports first
LAUNCHER_PID_ENV = "DECENT_TRAIN_LAUNCHER_PID"  # the forkserver's parent, which it dies with
# Hydra's flags that take a value (the next argument) and start a run all the same; any other flag prints something
# (--help, --cfg, --info, --shell-completion, ...) and trains nothing.
RUN_FLAGS = {"-m", "--multirun", "-cd", "--config-dir", "-cp", "--config-path", "-cn", "--config-name"}
NO_WORKERS_HERE = ("dry_run=true", "fault_tolerance.role=coordinator", "hydra/launcher=")


def launches_workers(args: list[str]) -> bool:
    """Whether a ``decent-train`` command with these arguments will likely start workers in this process: not one that
    prints help or a config, a dry run, a live run's coordinator (the nodes' agents start the workers), or a sweep
    whose jobs another Hydra launcher runs elsewhere (SLURM). A wrong guess costs seconds of a core: the forkserver dies
    with the command; a refused command's forkserver is killed as it exits."""
    flags = [a for a in args if a.startswith("-")]
    words = [a.lower().replace(" ", "") for a in args]
    return all(flag in RUN_FLAGS for flag in flags) and not any(w.startswith(NO_WORKERS_HERE) for w in words)


def spawn_forkserver() -> None:
    """Start, unless it runs, the forkserver, unbuffered as ``python -u`` is; it returns at once, while the forkserver
    imports (``launch.start_forkserver`` waits for it). From the main thread: the forkserver dies with the thread that
    started it (``PR_SET_PDEATHSIG``: decent_train/forkserver.py)."""
    import multiprocessing.forkserver  # here: cli.py imports this module before its handlers of Ctrl-C are set
    import multiprocessing.resource_tracker

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    multiprocessing.set_forkserver_preload([FORKSERVER_MODULE])
    # The terminal's Ctrl-C reaches this command's process group, which the forkserver starts in: it would end its
    # start-up with a KeyboardInterrupt traceback. It starts with SIGINT blocked, as multiprocessing starts its resource
    # tracker (first: it unblocks SIGINT here after), and unblocks it in a session of its own; here it waits until then.
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with environment(PYTHONUNBUFFERED="1"):
            multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the workers, unless the user set them, and restore them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def children_running(table: dict[str, tuple[str, bytes]], *names: str) -> set[str]:
    """The pids of this process's children in ``table`` (:func:`processes`) whose command line holds one of
    ``names``."""
    me = str(os.getpid())
    return {pid for pid, (parent, command) in table.items()
            if parent == me and any(name.encode() in command for name in names)}


def processes() -> dict[str, tuple[str, bytes]]:
    """pid -> (parent pid, command line) of every process (/proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]
                found[entry.name] = (parent, entry.joinpath("cmdline").read_bytes())
    return found
