"""Running a job in tests: a small worker-level config, training it in fork-started workers (tests/distributed.py),
the ``decent-train`` command in a subprocess, and reading what a run wrote. Plain functions, not fixtures: the
training helpers run inside forked workers."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from decent_train.config import METRICS_FILE, TrainConfig, check_config
from decent_train.training import train

WORLD = 2
COMMAND = Path(sys.executable).parent / "decent-train"


def make_cfg(run_dir: Path, **overrides: Any) -> TrainConfig:
    cfg: dict[str, Any] = {
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "optim": {"name": "accum_adamw", "lr": 0.01, "accum_iter": 2},
        "scheduler": {"name": "cosine", "warmup_steps": 2},
        "launch": {"nproc_per_node": WORLD},
        "logger": {"log_every": 2, "progress_bar": False},
        "steps": 6,
        "batch_size": 16,
        "accum_steps": 2,
        "eval_every": 3,
        "seed": 7,
        "run": {"output_dir": str(run_dir)},
    }
    for key, value in overrides.items():
        base = cfg.get(key, {})
        # another model or optimizer: the keys only the MLP or AccumAdamW reads go (they would be refused as unread)
        if key == "model" and value.get("name", "mlp") != "mlp":
            base = {}
        if key == "optim" and not value.get("name", "accum_").startswith("accum_"):
            base = {k: v for k, v in base.items() if k != "accum_iter"}
        cfg[key] = {**base, **value} if isinstance(value, dict) else value
    return check_config(cfg)


def train_on_cpu(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """``run_workers``' target: train ``cfg`` into its ``run.output_dir`` on the CPU."""
    return train(cfg, Path(cfg.run.output_dir), torch.device("cpu"))


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl, one dict per record."""
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def decent_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(COMMAND), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([str(COMMAND), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env} if env else None)


def check_succeeded(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a store or a rendezvous the test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of this run's worker processes (read from /proc): forked from the launcher's forkserver, they
    name themselves ``decent_train.worker CONFIG (rank R of W)``; started as ``python -m decent_train.worker CONFIG``
    (torchrun), their environment holds the rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"decent_train.worker" not in cmdline or str(run_dir).encode() not in cmdline:
            continue
        titled = re.search(rb"\(rank (\d+) of \d+\)", cmdline)
        rank = titled.group(1) if titled else next((e[5:] for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None:
            found[int(rank)] = int(entry.name)
    return found


def import_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (the scripts are not a package): to test a benchmark's functions."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(scripts)
