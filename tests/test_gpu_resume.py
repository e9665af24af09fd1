"""An averaged resume with the GPU's backend: 3 workers continue 4 workers' checkpoint, all on one GPU (NCCL if it
accepts ranks sharing the GPU, else gloo: tests/on_gpu.py), the float64 sums all-reduced in chunks on the device that
NCCL needs. Oracle: the mean of the 4 files, computed here in float64."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train.components.checkpoint import complete_checkpoints, load_latest_checkpoint, save_checkpoint

from tests.on_gpu import gpu_test, one_gpu_backend_or_skip, record, run_spawned

MODEL = {"name": "test"}
CHUNK = 1000  # elements per all-reduce: the sums go in several chunks, one larger than a chunk alone


def _save(rank: int, world: int, run_dir: str) -> None:
    from loguru import logger

    logger.remove()
    generator = torch.Generator().manual_seed(rank)
    state = {"model": {"w": torch.randn(300, 4, generator=generator, dtype=torch.float64),
                       "b": torch.randn(2500, generator=generator)},
             "step": 5 + rank}
    save_checkpoint(Path(run_dir), 5, state, "ring", MODEL, keep=1)


def _load(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from loguru import logger

    from decent_train.components import state_average

    logger.remove()
    state_average.ALL_REDUCE_ELEMENTS = CHUNK
    _, state = load_latest_checkpoint([Path(run_dir)], "ring", MODEL)
    assert state is not None
    return state


@pytest.mark.slow
@gpu_test
def test_an_averaged_resume_on_one_gpu_holds_the_files_mean() -> None:
    backend = one_gpu_backend_or_skip(needs_pairs=False)
    with tempfile.TemporaryDirectory() as folder:
        run_spawned(_save, 4, folder, backend=backend, one_gpu=True)
        (checkpoint,) = complete_checkpoints(Path(folder))
        saved = [torch.load(checkpoint.path / f"rank{r}.pt", weights_only=True) for r in range(4)]
        loaded = run_spawned(_load, 3, folder, backend=backend, one_gpu=True)
    deviation = 0.0
    for state in loaded:
        assert state["averaged_from"] == 4 and state["step"] == 5  # file 0's
        for name in ("w", "b"):
            mean = torch.stack([s["model"][name].double() for s in saved]).mean(0)
            assert state["model"][name].dtype == saved[0]["model"][name].dtype
            error = (state["model"][name].double() - mean).abs().max().item()
            assert error <= (1e-12 if name == "w" else 1e-6), (name, error)
            deviation = max(deviation, error) if name == "w" else deviation
    record("one-gpu/averaged-resume", backend=backend, float64_deviation=deviation)
