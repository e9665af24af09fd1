"""One ``decent-train`` command's work (``cli.py`` is its entry point, which imports this module): compose the config
with Hydra, check it, write it resolved, start the workers.

Hydra runs here once per job (never in the workers), so a job has one run directory and one composed config; the
workers read ``resolved_config.yaml``, the same file cluster scripts hand to torchrun on every node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from loguru import logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

import decent_train.algorithms  # noqa: F401 - registers every algorithm, and the schema of its options
from decent_train.components.checkpoint import complete_checkpoints
from decent_train.components.checks import as_override, schema_default
from decent_train.components.data import prepare as prepare_data
from decent_train.config import (
    ALGORITHM_TRAITS,
    METRICS_FILE,
    MODEL_FILE,
    RESOLVED_CONFIG,
    RESULT_FILE,
    LaunchConfig,
    PhaseConfig,
    TrainConfig,
    check_config,
    node_range,
)
from decent_train.launcher import help as help_module
from decent_train.launcher import interrupt
from decent_train.launcher.help import group_options, help_text
from decent_train.launcher.launch import (
    Interrupted,
    RendezvousFailed,
    WorkerFailure,
    check_devices,
    check_rendezvous_endpoint,
    format_command,
    launch_workers,
    slurm_rendezvous,
    torchrun_command,
)
from decent_train.launcher.run_dir import (
    check_one_run_dir, drop_refused_run_dir, hydra_record, write_hydra_record, write_whole,
)
from decent_train.launcher.sweep_check import SweepJobRefused, check_other_jobs, refuse_run_dir
from decent_train.launcher.preflight import preflight
from decent_train.launcher.node_agent import run_agent
from decent_train.launcher.supervisor import agent_command, run_supervised
from decent_train.training.stop import EXIT_STOPPED, STOP_FILE, Stop


def shipped_dir(name: str) -> str:
    """``conf`` or ``recipes`` as packaged (``decent_train/<name>`` in a wheel), else the checkout's (editable install)."""
    packaged = Path(__file__).resolve().parents[1] / name
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / name)


def with_recipes(argv: list[str]) -> list[str]:
    """Put the recipes on Hydra's search path (``--config-dir``) so that ``decent-train -cn NAME`` runs one, unless
    the user names a config dir of their own."""
    if any(a in ("-cd", "--config-dir") or a.startswith("--config-dir=") for a in argv[1:]):
        return argv
    return [argv[0], "--config-dir", shipped_dir("recipes"), *argv[1:]]


def _store_schemas() -> None:
    """The schema Hydra composes against (``base_train``, first in conf/train.yaml's defaults) and each algorithm's
    options schema: ``conf/algorithm/<name>.yaml`` of an algorithm with options of its own starts with
    ``defaults: [/algorithm_schema/<name>@_here_, _self_]``, so Hydra types them as it does every other group."""
    store = ConfigStore.instance()
    store.store(name="base_train", node=TrainConfig)
    for name, traits in ALGORITHM_TRAITS.items():
        store.store(group="algorithm_schema", name=name, node=traits.schema)


def _recipes() -> list[str]:
    """The recipes ``-cn`` takes (recipes/*.yaml)."""
    return sorted(p.stem for p in Path(shipped_dir("recipes")).glob("*.yaml"))


def _help(*, _root_: DictConfig) -> str:
    """conf/train.yaml's ``hydra.help.template``: the help for the config Hydra composed from the command line."""
    choices = {k: str(v) for k, v in _root_.hydra.runtime.choices.items() if v}
    return help_text(_root_, choices, group_options(Path(shipped_dir("conf"))), _recipes())


_store_schemas()
# conf/hydra/launcher/slurm.yaml: a SLURM sweep allocates the most nodes an elastic launch.nnodes=MIN:MAX asks for.
OmegaConf.register_new_resolver("max_nodes", lambda nnodes: node_range(nnodes)[1], replace=True)
OmegaConf.register_new_resolver("decent_train_help", _help, replace=True)


@hydra.main(version_base="1.3", config_path=shipped_dir("conf"), config_name="train")
def _run_job(cfg: DictConfig) -> float | None:
    """One Hydra job: returns the final test accuracy (what sweepers optimize).

    The user's mistakes end the job here, with one line; raising them would make Hydra print more around it.
    """
    _note_sweep()
    interrupt.raise_if_received()  # one a library swallowed between two jobs of a sweep
    record = hydra_record(cfg)  # before the checks fill in the run's keys
    try:
        return _check_and_launch(cfg, record)
    except Exception as error:  # noqa: BLE001 - sorted into the user's mistakes and our bugs by describe_error
        if isinstance(error, BrokenPipeError):  # decent-train dry_run=true | head
            interrupt.exit_output_closed()
        sig = interrupt.stop_signal(error)
        if sig is not None:  # an error in a stop's wake: the stop, which Hydra must not record as this job's failure
            raise interrupt.exception(sig) from None
        message = describe_error(error)
        if message is None:
            raise
        if isinstance(error, WorkerFailure):
            if error.traceback:
                print(error.traceback, file=sys.stderr)
            _exit_with(f"{message} (its log: {HydraConfig.get().runtime.output_dir}/logs/)", 1)
        if isinstance(error, RendezvousFailed):  # not the input's fault alone: the network, or the other nodes
            _exit_with(message, 1)
        drop_refused_run_dir(Path(HydraConfig.get().runtime.output_dir))
        _exit_with(message, 2)


def _check_and_launch(cfg: DictConfig, record: dict[str, str]) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    cfg.run.output_dir = str(run_dir)
    cfg.run.choices = {k: v for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra") and v}
    cfg.run.overrides = list(hydra_cfg.overrides.task)
    cfg.run.job_num = hydra_cfg.job.num if multirun else None
    cfg.run.sweep_dir = str(Path(hydra_cfg.sweep.dir).resolve()) if multirun else None
    if multirun:
        refuse_run_dir(hydra_cfg.overrides.hydra)
    if given := [o for o in hydra_cfg.overrides.task if o.lstrip("+~").startswith("run.")]:
        raise ValueError(f"{given[0]}: run.* are the launcher's facts about the job (its directory, choices and "
                         "overrides), written for the workers; not settings")
    train_cfg = _checked(cfg)
    if not multirun and not train_cfg.fault_tolerance.live:  # (live: the coordinator's directory is the run's)
        check_one_run_dir(train_cfg.launch, OmegaConf.to_container(hydra_cfg.run, resolve=False)["dir"])
    if train_cfg.fault_tolerance.live and train_cfg.fault_tolerance.role == "agent":
        write_hydra_record(run_dir, record)
        return _run_agent(train_cfg, run_dir)
    preflight(train_cfg)
    if multirun and _hydra_runs_the_sweep(hydra_cfg):
        check_other_jobs(lambda job, num: preflight(_checked(job, num)))
    write_hydra_record(run_dir, record)
    config_path = run_dir / RESOLVED_CONFIG
    resolved = OmegaConf.structured(train_cfg)
    resolved.dry_run = False  # what the workers run: the dry run's file too, so the command it prints trains this job
    write_whole(config_path, lambda partial: OmegaConf.save(resolved, partial))  # another node may read it

    if train_cfg.dry_run:
        _print_dry_run(train_cfg, config_path)
        return None
    # Several nodes share the run directory: each launcher's log is a file of its own (appends from several hosts to
    # one file on NFS can overwrite each other), named after its host.
    several = node_range(train_cfg.launch.nnodes)[1] > 1
    sink = logger.add(run_dir / (f"launcher-{socket.gethostname()}.log" if several else "launcher.log"), level="DEBUG")
    try:
        return _train(train_cfg, run_dir, config_path)
    finally:
        logger.remove(sink)


def _checked(cfg: DictConfig, sweep_job: int | None = None) -> TrainConfig:
    """The job's config, checked as far as it goes without its run directory: what this launch checks of its own
    job, and job 0 of a sweep of each other job (``sweep_job``: its number; sweep_check.py)."""
    if sweep_job is not None:
        cfg.run.job_num = sweep_job
    coordinating = cfg.fault_tolerance.get("role") == "coordinator"  # no worker here: each agent checks its node
    if cfg.launch.nproc_per_node is None:  # one worker per GPU
        if coordinating and cfg.launch.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("fault_tolerance.role=coordinator with launch.device=cuda on a host without a GPU: set "
                             "launch.nproc_per_node to the workers per node (the agents' GPUs)")
        if cfg.dry_run and cfg.launch.device == "cuda" and not torch.cuda.is_available():  # a login node's check
            raise ValueError("dry_run=true with launch.device=cuda on a host without a GPU (one worker per GPU): set "
                             "launch.nproc_per_node to the GPUs per node of the nodes that will run it")
        cfg.launch.nproc_per_node = max(1, torch.cuda.device_count())
    if not cfg.dry_run and not coordinating:  # a login node may check a job for GPU nodes
        check_devices(cfg.launch.device, cfg.launch.nproc_per_node, torch.cuda.is_available(), torch.cuda.device_count())
    if cfg.resume:
        cfg.resume = str(Path(cfg.resume).resolve())  # the workers may start elsewhere (another node's directory)
    if node_range(cfg.launch.nnodes)[1] > 1 and not cfg.launch.rdzv_endpoint and os.environ.get("SLURM_JOB_ID"):
        # One Hydra job on each node of a SLURM allocation (hydra/launcher=slurm with launch.nnodes > 1).
        cfg.launch.rdzv_endpoint, cfg.launch.rdzv_id = slurm_rendezvous()
    train_cfg = check_config(cfg)
    check_rendezvous_endpoint(train_cfg.launch)
    return train_cfg


def _run_agent(cfg: TrainConfig, run_dir: Path) -> None:
    """``fault_tolerance.role=agent``: this node's workers for the coordinator at ``launch.rdzv_endpoint``, which
    checked the job and writes its results; this launch ends when the coordinator ends the run."""
    if cfg.dry_run:
        print(f"dry run: nothing trained\n  workers:  {cfg.launch.nproc_per_node} x python -m decent_train.worker, "
              f"started by this node's agent for the coordinator at {cfg.launch.rdzv_endpoint} (its job)", flush=True)
        return None
    sink = logger.add(run_dir / "launcher.log", level="DEBUG")
    try:
        run_agent(cfg, run_dir)
    finally:
        logger.remove(sink)
    print(f"decent-train: node agent done (coordinator {cfg.launch.rdzv_endpoint}); outputs in the coordinator's "
          "run directory", flush=True)
    return None


def _train(cfg: TrainConfig, run_dir: Path, config_path: Path) -> float:
    if cfg.phases:
        what = "phases " + " > ".join(mode for _, mode in cfg.phase_starts())
    else:
        what = f"topology={cfg.topology.name}" if cfg.gossips else "all-reduce"
        if ALGORITHM_TRAITS[cfg.algorithm.name].local_steps:  # the topology mixes the outer steps
            what = f"algorithm={cfg.algorithm.name}, sync_every={getattr(cfg.algorithm, 'sync_every')}, {what}"
    if cfg.compression.name != "none":
        what += f", compression={cfg.compression.name}"
        if cfg.compression.copy_dtype != "param":
            what += f" (copies in {cfg.compression.copy_dtype})"
    logger.info(f"{_workers(cfg.launch, cfg.parallel.shard)} on {cfg.launch.device}, {what}; outputs in {run_dir}")
    start = time.perf_counter()
    prepare_data(cfg.dataset)  # a download happens once, here, not in every worker
    changes = None
    (run_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier launch's, into the same directory
    interrupt.raise_if_received()  # a stop that a library swallowed since (a finalizer, an import) still ends it here
    try:  # a signal: the workers stop at a step they agree on, with a checkpoint (training/stop.py)
        if cfg.fault_tolerance.live:
            changes, received = run_supervised(cfg, config_path, run_dir)
        else:
            received = launch_workers(cfg.launch, config_path)
    except Interrupted as interrupted:  # a second Ctrl-C
        _exit_stopped(cfg, run_dir, interrupted.sig)
    stop = Stop.read(run_dir)
    if stop is not None:  # what this launcher received, else what a worker did (a user's kill, another node's)
        if received is not None and stop.signal != received.name:  # the workers got it as SIGUSR1 (launch.py)
            dataclasses.replace(stop, signal=received.name).write(run_dir)
        _exit_stopped(cfg, run_dir, received or signal.Signals[stop.signal])
    wall = time.perf_counter() - start
    result = complete_result(run_dir / RESULT_FILE, wall, changes)
    ended_on = result.get("topology")  # live: a membership change may have made the workers fall back to another
    if not cfg.phases and cfg.gossips and ended_on not in (None, cfg.topology.name):
        what = what.replace(f"topology={cfg.topology.name}", f"topology={cfg.topology.name} (ended on {ended_on})", 1)
    if result["resumed_from_step"] < result["steps"]:
        speed = f"{result['throughput/samples_per_s']:.0f} samples/s over"
    else:  # resumed from the final checkpoint: only the evaluation was left
        speed = "resumed at the end, evaluated on"
    print(
        f"decent-train: eval/accuracy {result['eval/accuracy']:.4f}, eval/loss {result['eval/loss']:.4f} after "
        f"{result['steps']} steps; {speed} {_workers(cfg.launch, cfg.parallel.shard, result['world_size'])}, {what}; "
        f"{wall:.1f} s in all\n"
        f"  outputs: {run_dir}  ({MODEL_FILE}: the {'averaged' if cfg.final_average else 'rank 0'} model's state_dict; "
        f"{METRICS_FILE}, {RESULT_FILE}, logs/)",
        flush=True,
    )
    return float(result["eval/accuracy"])


def complete_result(path: Path, wall: float, changes: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Rank 0's ``result.json`` with this launch's wall time (unless it only evaluated a finished run: the training's
    stays) and membership changes. Outside SLURM every node's launcher completes it (none knows it is the first
    node): each writes a file of its own and renames it over the result, so a node reading it never sees another's
    half-written (measured: 4 of 7 three-node torchrun runs failed on a plain rewrite). The last node to finish gives
    the wall time."""
    result = json.loads(path.read_text())  # rank 0 wrote it before every worker left (a barrier)
    if changes is not None:
        result["membership_changes"] = changes
    if os.environ.get("SLURM_NODEID", "0") == "0":  # on SLURM, the first node completes it
        if result.get("resumed_from_step") != result.get("steps") or "wall_time_s" not in result:  # else the training's
            result["wall_time_s"] = wall
        write_whole(path, lambda partial: partial.write_text(json.dumps(result, indent=2) + "\n"))
    return result


def _exit_stopped(cfg: TrainConfig, run_dir: Path, sig: signal.Signals) -> None:
    """One line on how the run stopped and how to go on (in a sweep: with all of it, :func:`_note_sweep`); exit
    :data:`EXIT_STOPPED` when every worker saved at the step they agreed on, 128 + the signal's number when they were
    killed before (a second Ctrl-C)."""
    stop = Stop.read(run_dir)
    sweep = f", in job {cfg.run.job_num} of a sweep; {_go_on_with_the_sweep()}" if _sweep_go_on else ""
    if stop is None:
        kept = complete_checkpoints(run_dir)
        since = f"the newest checkpoint is {kept[0].path}" if kept else "no checkpoint was written"
        print(f"decent-train: stopped by {sig.name} at once, without a checkpoint of its own ({since}){sweep}",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + int(sig))
    if not sweep:
        kept_overrides = [o for o in cfg.run.overrides if not o.lstrip("+~").startswith(("hydra.", "resume="))]
        sweep = "; to go on: " + format_command(["decent-train", f"resume={run_dir}", *kept_overrides])
    requeued = _requeued_by_submitit(sig)
    if requeued is not None:
        sweep = "; submitit requeued the job, which continues from it"
    print(f"decent-train: stopped by {sig.name} at step {stop.step} of {stop.total_steps} with a checkpoint "
          f"({stop.checkpoint}){sweep}", file=sys.stderr, flush=True)
    raise requeued or SystemExit(EXIT_STOPPED)


def _requeued_by_submitit(sig: signal.Signals) -> SystemExit | None:
    """A SLURM sweep's job (hydra/launcher=slurm) stopped by submitit's signal (SIGUSR2: before the time limit, or a
    preemption), now that its workers saved: submitit's own handler of it, which the launch held back while the
    workers stopped (launch.StopForwarding), requeues the job and asks this process to end (its SystemExit, returned);
    the requeued job continues from the checkpoint (preflight.check_continuation). None where it does not requeue
    (more timeouts than ``hydra.launcher.max_num_timeout``: it raises), or outside such a job."""
    handler = signal.getsignal(sig)
    if sig != signal.SIGUSR2 or "SUBMITIT_FOLDER" not in os.environ or not callable(handler):
        return None
    try:
        handler(int(sig), None)
    except SystemExit as requeued:
        return requeued
    except Exception:  # submitit's UncompletedJobError: not requeued
        return None
    return None


COMMAND_LINE: list[str] = []  # the words after decent-train, as given (run() keeps them; a sweep's lists are in them)
_sweep_go_on: list[str] = []  # in a sweep that a stop ends: the command that goes on with it (_note_sweep)


def _note_sweep() -> None:
    """At each job's start, in a sweep that a stop ends (Hydra's own sweeper and launcher: a grid, one job after
    another in this process; a SLURM sweep's jobs are processes of their own, each stopped and requeued alone): the
    command that goes on with it, its own command line into its directory. Run again there, a sweep has the same jobs
    in the same run directories, and a launch into a run directory that holds checkpoints continues them (with the
    same settings: preflight.check_continuation): a stopped job from its newest checkpoint, a finished one from its
    final checkpoint (written whatever ``checkpoint.every``: only evaluated again), a job not begun from step 0."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or not COMMAND_LINE or not _hydra_runs_the_sweep(hydra_cfg):
        return
    words = [w for w in COMMAND_LINE if not w.lstrip("+").startswith("hydra.sweep.dir=")]
    sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
    _sweep_go_on[:] = [format_command(["decent-train", *words, f"hydra.sweep.dir={sweep_dir}"])]


def _hydra_runs_the_sweep(hydra_cfg: DictConfig) -> bool:
    """Hydra's own sweeper (a grid) and launcher (its jobs one after another, in this process)."""
    return (str(hydra_cfg.launcher.get("_target_")).endswith(".BasicLauncher")
            and str(hydra_cfg.sweeper.get("_target_")).endswith(".BasicSweeper"))


def _go_on_with_the_sweep() -> str:
    return ("to go on with the sweep (its jobs continue from their newest checkpoints, the finished ones are only "
            f"evaluated again): {_sweep_go_on[0]}")


def _print_dry_run(cfg: TrainConfig, config_path: Path) -> None:
    if cfg.phases:
        summary = cfg.schedule()
    elif cfg.gossips:
        summary = cfg.build_topology().describe()
        if cfg.parallel.shard > 1:
            summary = f"{_workers(cfg.launch, cfg.parallel.shard)}; the replicas gossip: {summary}"
    else:
        summary = f"all-reduce (torch DDP) over {_workers(cfg.launch)}"
    print(f"dry run: nothing trained\n  topology: {summary}\n  config:   {config_path}")
    if cfg.fault_tolerance.live and cfg.fault_tolerance.role == "coordinator":
        workers = (f"none here: this launch is the coordinator alone; on each node: "
                   f"{agent_command(cfg, cfg.launch.rdzv_endpoint)}")
    elif cfg.fault_tolerance.live:
        workers = (f"{cfg.launch.nproc_per_node} x python -m decent_train.worker {config_path}, started by "
                   "decent-train itself (fault_tolerance=live: it hosts their store and decides who is in the run)")
    else:
        workers = format_command(torchrun_command(cfg.launch, config_path))
    print(f"  workers:  {workers}", flush=True)


def _workers(launch: LaunchConfig, shard: int = 1, world_size: int | None = None) -> str:
    """How many workers (``world_size``, else the launch's: ``4 workers``, or an elastic job's range, ``2 to 4
    workers``), and with ``parallel.shard`` > 1 how they hold the model: ``4 workers (2 replicas x 2 shards)``."""
    sizes = [world_size] if world_size is not None else launch.world_sizes

    def span(divisor: int = 1) -> str:
        low, high = sizes[0] // divisor, sizes[-1] // divisor
        return f"{low} to {high}" if low != high else str(low)

    return f"{span()} workers" + (f" ({span(shard)} replicas x {shard} shards)" if shard > 1 else "")


_LIST_ENTRIES = {PhaseConfig: "in each entry of phases"}  # list entries: OmegaConf reports no parent key


def describe_error(error: BaseException) -> str | None:
    """One line naming the bad value and what is valid, for errors caused by the user's input; None for bugs."""
    if (isinstance(error, (ValueError, WorkerFailure, JobFailed, RendezvousFailed))
            and not isinstance(error, OmegaConfBaseException)):
        return str(error)
    if isinstance(error, SweepJobRefused):
        message = describe_error(error.cause)
        return None if message is None else f"{error}: {message}; no job has trained"
    if isinstance(error, OSError) and _raised_by_hydra_output(error):
        return unwritable_run_dir(error)
    if isinstance(error, OverrideParseException):
        return unparsable_override(error.override, error.message)
    if isinstance(error, MissingConfigException) and str(error).startswith("Cannot find primary config"):
        return f"-cn {error.missing_cfg_file} is not a recipe; valid: {', '.join(_recipes())} (or train, the default)"
    if isinstance(error, MissingConfigException) and error.options is not None and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option; valid: {', '.join(error.options)}"
    cause = error.__cause__ if isinstance(error, ConfigCompositionException) else error
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        parent = str(cause.full_key).rpartition(".")[0]
        valid = _field_names(cause.object_type)
        where = f"in {parent}" if parent else _LIST_ENTRIES.get(cause.object_type, "at the top level")
        if not valid:
            return str(cause.msg)
        return f"{cause.full_key} is not a key; valid {where}: {', '.join(valid)}{_algorithm_hint(cause.full_key)}"
    if isinstance(cause, ValidationError) and cause.full_key and _expected_shape(cause):
        return f"{cause.full_key}={as_override(cause.value)}: {_expected_shape(cause)}"
    if isinstance(cause, OmegaConfBaseException):
        message = str(cause.msg).strip().splitlines()[0]
        return f"{cause.full_key}: {message}" if getattr(cause, "full_key", None) else message
    if isinstance(error, HydraException):
        return str(error).strip().splitlines()[0]
    return None


def _expected_shape(cause: ValidationError) -> str | None:
    """What a value of the wrong shape should look like (OmegaConf says "int is not a ListConfig"), with the
    schema's default as the example; None for other validation errors."""
    key = str(cause.full_key).rpartition(".")[2]
    if "is not a ListConfig" in str(cause.msg) and dataclasses.is_dataclass(cause.object_type):
        return f"expected a list, e.g. {cause.full_key}={as_override(schema_default(cause.object_type, key))}"
    if "is not a subclass of PhaseConfig" in str(cause.msg):
        return ("each phase is {algorithm: allreduce|decentralized, topology: NAME, steps: N}, e.g. "
                "'phases=[{algorithm:allreduce,steps:100},{topology:ring}]'")
    return None


def unparsable_override(word: str, hydra_message: str) -> str:
    """One line for a command-line word that Hydra's override grammar cannot read (``topology ring`` for
    ``topology=ring``): the word, what was expected, and an example built from the word when it names a group."""
    groups = group_options(Path(shipped_dir("conf")))
    key = word.lstrip("+~").partition("=")[0]
    if key in groups:
        options = groups[key]
        default = getattr(getattr(TrainConfig, "__dataclass_fields__", {}).get(key), "default_factory", None)
        chosen = getattr(default(), "name", None) if callable(default) else None
        example = f"{key}={chosen if chosen in options else options[0]}"
    elif key.replace(".", "").replace("_", "").isalnum():
        example = f"{word[:len(word) - len(word.lstrip('+'))]}{key}=VALUE"
    else:
        example = "topology=ring"
    expected = f"expected key=value, e.g. {example} (see decent-train --help)"
    if "=" not in word and not word.startswith("~"):
        return f"{word!r} is not key=value; {expected}"
    lines = [line for line in hydra_message.splitlines()
             if line.strip() and not line.startswith(("Error parsing override", "See https://"))]
    if lines and lines[0].startswith("LexerNoViableAltException"):  # the next line's caret marks the character
        column = len(lines[1]) - len("LexerNoViableAltException: ") - 1 if len(lines) > 1 else -1
        lines = [f"unexpected character {word[column]!r}" if 0 <= column < len(word) else "unexpected character"]
    reason = f" ({lines[0].strip()})" if lines else ""
    return f"{word!r} cannot be read as key=value{reason}; {expected}"


def _raised_by_hydra_output(error: OSError) -> bool:
    """Whether Hydra raised ``error`` making the run (or sweep) directory or writing its ``.hydra/`` files: that
    happens before ``_run_job``, so the preflight cannot check it first; any other OSError is not sorted here. The
    innermost frame of Hydra's or ours must be Hydra's: one raised in our job and re-raised by Hydra is not."""
    ours = (f"{os.sep}hydra{os.sep}", f"{os.sep}decent_train{os.sep}")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if any(p in f.filename for p in ours)]
    return bool(frames) and ours[0] in frames[-1].filename and frames[-1].name in (
        "run_job", "_save_config", "launch", "sweep")


def _hydra_output_dir(error: OSError) -> Path | None:
    """The directory Hydra was making or writing when ``error`` (a full disk names no file) was raised: its frames'
    ``output_dir`` or ``sweep_dir``, the innermost."""
    found, tb = None, error.__traceback__
    while tb is not None:
        names = tb.tb_frame.f_locals
        found = names.get("output_dir") or names.get("sweep_dir") or found
        tb = tb.tb_next
    return Path(str(found)) if found is not None else None


def unwritable_run_dir(error: OSError) -> str:
    """One line for a run directory that cannot be made or written: which key sets it, the path, why (an ancestor
    that is a file, named), and what is valid."""
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in sys.argv[1:]) else "hydra.run.dir"
    path = Path(str(error.filename)) if error.filename else _hydra_output_dir(error)
    why = error.strerror or str(error)
    if path is not None:
        blocking = next((p for p in [path, *path.parents] if p.exists()), None)
        if blocking is not None and not blocking.is_dir():
            why += f": {blocking} is a file"
    return f"{key}: cannot create or write {path} ({why}); give {key}=<a directory you can write to>"


def _algorithm_hint(full_key: str) -> str:
    """Where ``algorithm.KEY`` is another algorithm's option: which, and ``++`` for a sweep over ``algorithm=`` (Hydra
    composes the sweep's base config with the default algorithm first, where the option is no key)."""
    group, _, key = full_key.partition(".")
    owners = [name for name, traits in ALGORITHM_TRAITS.items() if key in _field_names(traits.schema)]
    if group != "algorithm" or not owners:
        return ""
    return f" ({key} is an option of algorithm={'|'.join(owners)}: choose one, or in a sweep over algorithm= write " \
           f"++{full_key}=...)"


def _field_names(object_type: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(object_type)] if dataclasses.is_dataclass(object_type) else []


class JobFailed(RuntimeError):
    """A job of a SLURM sweep failed (the message is its one line): raised, not an exit, so that submitit sends it
    back to the submitting host instead of leaving it to wait for the job's result."""


def _exit_with(message: str, status: int) -> None:
    print(f"decent-train: error: {message}", file=sys.stderr, flush=True)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        raise JobFailed(message)
    raise SystemExit(status)


def run() -> None:
    """The command, once ``cli.main`` has set the stop signals' handlers (interrupt.py): errors in the user's input end
    in one line on stderr and exit status 2; a stop signal goes on to ``cli.main``, which says so in one line."""
    COMMAND_LINE[:] = sys.argv[1:]
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # make Hydra raise, so we can say what is wrong in one line
    logger.enable("decent_train")  # the package is silent as a library (decent_train/__init__.py), not as a command
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="<green>{time:HH:mm:ss}</green> | <level>{message}</level>")
    if "--help-all" in sys.argv[1:]:  # every key that applies, not only those most runs set
        help_module.SHOW_ALL = True
        sys.argv = [a if a != "--help-all" else "--help" for a in sys.argv]
    sys.argv = with_recipes(sys.argv)
    try:
        _run_job()
    except (KeyboardInterrupt, interrupt.Stopped, Exception) as error:  # noqa: BLE001 - composition errors end here
        sig = interrupt.stop_signal(error)
        if sig is not None and _sweep_go_on:  # a stop outside a job's workers (before them, after, between jobs)
            print(f"decent-train: stopped by {sig.name} in a sweep, while no job trained (no checkpoint was written "
                  f"at this stop); {_go_on_with_the_sweep()}", file=sys.stderr, flush=True)
            raise SystemExit(128 + int(sig)) from None
        message = None if full_error or sig is not None else describe_error(error)
        if message is None:  # a bug, or a stop (cli.main says so)
            raise
        _exit_with(message, 1 if isinstance(error, JobFailed) else 2)  # a SLURM job's failure, already checked
    finally:
        if not full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)
