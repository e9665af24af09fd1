"""The worker: ``python -m decent_train.worker RUN_DIR/resolved_config.yaml``, one process per rank under torchrun.

It never runs Hydra: it reads the resolved config the launcher wrote, joins the process group, trains, evaluates the
average of the workers' models, and (rank 0) writes metrics.jsonl, result.json and the averaged model.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger
from setproctitle import setproctitle
from torch.distributed.elastic.multiprocessing.errors import record

from decent_train.components.metrics import setup_worker_logging
from decent_train.config import load_config
from decent_train.engine.comm import peers_must_answer
from decent_train.runtime import WholeErrorFile, die_with_agent, init_distributed
from decent_train.training import stop, train
from decent_train.training.live import MEMBER_ENV, STORE_ENV, LiveMembership, connect

FORKSERVER_ENVIRON: dict[str, str] = {}  # the forkserver's environment, in the processes forked from it


@functools.partial(record, error_handler=WholeErrorFile())
def main(argv: list[str] | None = None) -> None:
    die_with_agent()
    logger.enable("decent_train")  # silent as a library (decent_train/__init__.py); a worker logs to its file
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m decent_train.worker RUN_DIR/resolved_config.yaml   (under torchrun)")
    config_path = Path(args[0]).resolve()
    cfg = load_config(config_path)
    run_dir = Path(cfg.run.output_dir) if cfg.run.output_dir else config_path.parent
    live = None
    # The launcher passes a stop signal on (torchrun's path and launcher/supervisor.py alike), or leaves it in a file
    # beside the config for a worker it could not reach yet.
    stop.install(config_path.parent / stop.REQUEST_FILE)
    if STORE_ENV in os.environ:  # fault_tolerance=live: the launcher's coordinator says who is in the run
        store, member = connect(timedelta(seconds=cfg.pg_timeout_s))
        live = LiveMembership(store, member, timedelta(seconds=cfg.comm_timeout_s))
        device = live.start(cfg.launch.device)  # train() joins the members once its model is built
        setup_worker_logging(run_dir, member, cfg.logger, name=f"member{member}")  # founders: member id = rank
    else:
        device = init_distributed(cfg.launch.device, timedelta(seconds=cfg.pg_timeout_s))
        setup_worker_logging(run_dir, dist.get_rank(), cfg.logger)
    finished = False
    try:
        try:
            train(cfg, run_dir, device, live=live)
        except stop.TrainingStopped as stopped:  # on a signal, with a checkpoint: exit 0 (training/stop.py)
            if dist.get_rank() == 0:
                stopped.stop.write(run_dir)
        gc.collect()  # free the engine (its hooks make reference cycles) while its process groups are alive
        with peers_must_answer("the barrier at the end of training"):
            dist.barrier()  # leave together: a peer tearing down gloo while others still talk to it aborts them
        finished = True
    except Exception as error:
        # The traceback goes to this rank's log and to the error file the launcher reports from; not to the console
        # of every rank.
        logger.opt(exception=error).debug(f"rank {dist.get_rank()} failed")
        WholeErrorFile().record_exception(error)
        sys.exit(1)
    finally:
        if live is not None:
            live.close(finished)
        dist.destroy_process_group()
    logger.complete()  # everything is written and the process group is gone; the interpreter exits as usual


def forked(config_path: str, cwd: str, environ: dict[str, str]) -> None:
    """The worker, forked from the launcher's forkserver (decent_train/forkserver.py) rather than started as
    ``python -m decent_train.worker CONFIG``: the same run, the same exit status."""
    take_the_launch(config_path, cwd, environ)
    try:
        main()
    except Exception:  # main's @record wrote the error file, whole; the agent's @record around this would rewrite it
        sys.exit(1)


def take_the_launch(config_path: str, cwd: str, environ: dict[str, str]) -> None:
    """Make this process, forked from the forkserver, what the launcher would have started now as an interpreter.
    The forkserver outlives a launch and kept the directory and environment of the first: this takes those of the
    launcher at this launch (``cwd``, ``environ``), with what torch's agent set for this worker over them (rank,
    store), and the forkserver in place of the launcher as the process it dies with."""
    # Its command line is the forkserver's: ps, top and pgrep -f show this instead. First: setproctitle finds the
    # command line's memory through the environment's, as the process started.
    member = environ.get(MEMBER_ENV)  # fault_tolerance=live: a member, ranked by the coordinator later
    who = f"member {member}" if member else f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')}"
    setproctitle(f"decent_train.worker {config_path} ({who})")
    agents = {k: v for k, v in os.environ.items() if FORKSERVER_ENVIRON.get(k) != v}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(agents)
    os.environ[stop.AGENT_PID_ENV] = FORKSERVER_ENVIRON[stop.AGENT_PID_ENV]
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):  # the forkserver ignores them (forkserver.py)
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(cwd)
    sys.argv = [__file__, config_path]
    # multiprocessing made the forkserver this process's default way to start one; the platform's, as in a fresh
    # interpreter (a DataLoader's workers, tqdm's lock: a forkserver's locks are named, a killed worker's outlive it)
    multiprocessing.set_start_method(None, force=True)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # OpenMP read it once, as the forkserver imported torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


if __name__ == "__main__":
    main()
