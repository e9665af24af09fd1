"""Where a run's numbers and messages go: metrics.jsonl and the console (rank 0), a log file per rank."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from loguru import logger
from tqdm import tqdm

LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR")


@dataclass
class LoggerConfig:
    """``conf/logger/*.yaml``."""

    log_every: int = 10  # optimizer steps between metric records
    progress_bar: bool = True  # rank 0, on the console
    console_level: str = "INFO"  # rank 0's console; every rank's file gets DEBUG

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ValueError(f"logger.log_every={self.log_every} must be >= 1")
        if self.console_level.upper() not in LEVELS:
            raise ValueError(f"logger.console_level={self.console_level!r} is not a level; valid: {', '.join(LEVELS)}")


def setup_worker_logging(run_dir: Path, rank: int, cfg: LoggerConfig) -> None:
    """Every rank logs everything to ``logs/rank<k>.log``; rank 0 also to the console (above its progress bar)."""
    logger.remove()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logger.add(run_dir / "logs" / f"rank{rank}.log", level="DEBUG", diagnose=False)
    if rank == 0:
        logger.add(
            lambda message: tqdm.write(message, end="", file=sys.stderr),
            level=cfg.console_level.upper(),
            format="<green>{time:HH:mm:ss}</green> | <level>{message}</level>",
            colorize=sys.stderr.isatty(),
        )


class MetricLogger:
    """One JSON object per record in ``metrics.jsonl`` (namespaced keys such as ``train/loss``), written by rank 0."""

    def __init__(self, path: Path | None):
        self._file: TextIO | None = path.open("a") if path is not None else None

    def log(self, metrics: dict[str, Any]) -> None:
        if self._file is None:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        logger.debug(" ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
