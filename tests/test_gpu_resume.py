"""An averaged resume with the GPU's backend: 3 workers continue 4 workers' checkpoint, all on one GPU (NCCL if it
accepts ranks sharing the GPU, else gloo: tests/on_gpu.py), the float64 sums all-reduced in chunks on the device that
NCCL needs. Oracle: the mean of the 4 files, computed here in float64. And the chunked all-reduce of a sharded
resume's sums, which mix GPU shards with CPU step counts (torch.optim keeps ``step`` on the CPU), against the sums
computed here."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from decent_train.components.checkpoint import complete_checkpoints, load_latest_checkpoint, save_checkpoint

from tests.on_gpu import DEVICE, gpu_test, one_gpu_backend_or_skip, record, run_spawned

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


def _all_reduce_mixed(rank: int, world: int) -> list[torch.Tensor]:
    from decent_train.components.state_average import all_reduce_in_chunks

    device = torch.device(DEVICE.type, torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    tensors = [torch.full((700,), 1.0 + rank, dtype=torch.float64, device=device),
               torch.tensor([10.0 * (rank + 1)], dtype=torch.float64),  # a step count: on the CPU
               torch.arange(900, dtype=torch.float64, device=device) * (rank + 1)]
    all_reduce_in_chunks(tensors, "the test's all-reduce")
    assert [t.device for t in tensors][:2] == [device, torch.device("cpu")]
    return [t.cpu() for t in tensors]


@pytest.mark.slow
@gpu_test
def test_chunked_all_reduce_of_gpu_and_cpu_tensors_on_one_gpu() -> None:
    """2 ranks on one GPU: GPU tensors and a CPU one in one call (each device's chunks apart, the CPU one through the
    GPU under NCCL), every sum as computed here, in place on its own device."""
    backend = one_gpu_backend_or_skip(needs_pairs=False)
    ranks = run_spawned(_all_reduce_mixed, 2, backend=backend, one_gpu=True)
    want = [torch.full((700,), 3.0, dtype=torch.float64), torch.tensor([30.0], dtype=torch.float64),
            torch.arange(900, dtype=torch.float64) * 3]
    for got in ranks:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    record("one-gpu/all-reduce-mixed-devices", backend=backend)
