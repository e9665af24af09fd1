"""Host syncs on CUDA: the engine and the fronts make the host wait for the GPU no more often per step than a plain
loop with torch's fused AdamW does (no host sync per bucket: docs/gpus.md). Counted by CUDA's own sync detector
(``torch.cuda.set_sync_debug_mode``: every D2H copy, ``.item()``, stream or event synchronize, blocking H2D copy),
not by patching the calls we know of; each sync is named by the Python line that made it. Marked ``gpu``:
``bash scripts/gpu_check.sh`` runs it; ``GPU_CHECK_DEVICE=cpu`` runs the bodies on the CPU, where nothing syncs.

At world size 1 (a group of one), bf16 autocast, a tiny GPT-2, 2 warm-up steps then 8 counted:
- the engine: every step at most the plain loop's syncs;
- ``Gossip``: every step at most the plain loop's;
- ``DiLoCo`` (4 inner steps per outer step, offloaded: the default on CUDA) and ``LocalSGD``: every inner step at most
  the plain loop's; the outer steps' syncs are recorded, not bounded (once per H steps).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from decent_train import DecentralizedDataParallel, DiLoCo, Gossip, LocalSGD, optim_fn_adamw
from tests.on_gpu import DEVICE, gpu_test, record
from tests.test_gpu import TINY_GPT, gpt_batches, group_of_one, tiny_gpt  # noqa: F401 - group_of_one is a fixture

WARMUP, STEPS, SYNC_EVERY = 2, 8, 4
LR = 1e-3


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """The ``file:line`` of each synchronizing CUDA call made while the block runs (filled when it ends); none on the
    CPU. CUDA's detector warns from C++, attributed to the Python line that called in."""
    found: list[str] = []
    if DEVICE.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=DEVICE.type == "cuda")


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


def _syncs_per_step(kind: str) -> list[list[str]]:
    """The syncs of each counted step of ``kind``: plain, engine, gossip, diloco or localsgd."""
    batches = gpt_batches(TINY_GPT["vocab"], TINY_GPT["context"], 8, WARMUP + STEPS)
    model = tiny_gpt()
    if kind == "engine":
        engine = DecentralizedDataParallel(model, partial(optim_fn_adamw, lr=LR), topology="ring",
                                           bucket_size_in_mb=0.5)  # several buckets
        step: Callable[[torch.Tensor, torch.Tensor], None] = lambda x, y: _loss(engine, x, y).backward()
        front: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        inner = _adamw(model.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            _loss(model, x, y).backward()
            inner.step()
            inner.zero_grad(set_to_none=True)

        outer = partial(torch.optim.SGD, model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        front = {"plain": contextlib.nullcontext, "gossip": lambda: Gossip(model, inner, "ring"),
                 "diloco": lambda: DiLoCo(model, inner, outer(), SYNC_EVERY, "complete"),
                 "localsgd": lambda: LocalSGD(model, inner, SYNC_EVERY, "complete")}[kind]()
    counted: list[list[str]] = []
    with front:
        for i, (x, y) in enumerate(batches):
            with host_syncs() as syncs:
                step(x, y)
            if i >= WARMUP:
                counted.append(syncs)
    return counted


def _is_outer(counted_step: int) -> bool:
    return (WARMUP + counted_step + 1) % SYNC_EVERY == 0


@gpu_test
def test_no_more_host_syncs_per_step_than_a_plain_loop(group_of_one: None) -> None:
    plain = _syncs_per_step("plain")
    most = max(len(s) for s in plain)
    over: dict[str, list[tuple[int, list[str]]]] = {}
    for kind in ("engine", "gossip", "diloco", "localsgd"):
        runs = _syncs_per_step(kind)
        local_steps = kind in ("diloco", "localsgd")
        bounded = [(i, s) for i, s in enumerate(runs) if not (local_steps and _is_outer(i))]
        record(f"host-syncs/{kind}", plain_per_step=[len(s) for s in plain], per_step=[len(s) for s in runs],
               outer_steps=[i for i in range(STEPS) if local_steps and _is_outer(i)],
               where=sorted({line for s in runs for line in s}), plain_where=sorted({x for s in plain for x in s}))
        if any(len(s) > most for _, s in bounded):
            over[kind] = [(i, s) for i, s in bounded if len(s) > most]
    assert not over, f"steps with more host syncs than the plain loop's {most}: {over}"
