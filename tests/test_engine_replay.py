"""Every worker's parameters equal the float64 single-process replay of the recurrence (tests/replay.py)."""

from __future__ import annotations

from functools import partial

import pytest

from decent_train import lr_scheduler_fn_cosine_with_warmup, optim_fn_accum_adamw, optim_fn_adam
from tests.distributed import run_workers
from tests.replay import max_deviation, replay, topology_for, train_engine

STEPS = 12
TOL = 1e-12


@pytest.mark.parametrize(
    "topology, world_size, local_world_size",
    [
        ("complete", 4, 1),
        ("ring", 4, 1),
        ("one-peer-exp", 4, 1),
        ("alternating-exp-ring", 4, 2),
        ("alternating-exp-ring", 4, 1),
        ("ring", 2, 1),
        ("ring", 8, 1),
        ("one-peer-exp", 8, 1),
        ("ring", 3, 1),
        ("ring", 5, 1),
        ("complete", 3, 1),
        ("complete", 1, 1),
    ],
)
def test_matches_replay(topology: str, world_size: int, local_world_size: int) -> None:
    engine = run_workers(
        train_engine, world_size, topology=topology, steps=STEPS, local_world_size=local_world_size
    )
    assert len(engine[0]["buckets"]) >= 3, "the test model must span several buckets"
    assert all(r["step"] == STEPS for r in engine)
    expected = replay(topology_for(topology, world_size, local_world_size), STEPS)
    assert max_deviation(engine, expected) <= TOL


def test_replay_distinguishes_the_schedule() -> None:
    """The oracle is sensitive to the round schedule: a shifted schedule moves the parameters by far more than TOL."""
    ring = topology_for("ring", 4)
    shifted = topology_for("ring", 4)
    shifted.rounds = shifted.rounds[::-1]
    a, b = replay(ring, STEPS), replay(shifted, STEPS)
    assert max(((x[k] - y[k]).abs().max().item() for x, y in zip(a, b) for k in x)) > 1e-6


SCHEDULE = partial(lr_scheduler_fn_cosine_with_warmup, t_max=10, t_warmup=3)

# name: (arguments for both the engine and the replay, engine-only arguments)
VARIANTS: dict[str, tuple[dict, dict]] = {
    "adam_with_scheduler": (dict(optim_fn=partial(optim_fn_adam, lr=0.01), lr_scheduler_fn=SCHEDULE), {}),
    "accum_adamw": (dict(optim_fn=partial(optim_fn_accum_adamw, lr=0.01, accum_iter=3)), {}),
    "no_bucket_view": ({}, dict(param_as_bucket_view=False)),
    "adaptive_factor": (dict(adaptive_factor=0.3), {}),
    "one_bucket": ({}, dict(bucket_size_in_mb=25)),
    "split_messages": ({}, dict(bucket_size_in_mb=25, message_size_in_mb=0.0002)),  # ~200-byte messages
    "micro_batches": (dict(micro_batches=3), {}),
    "clip": (dict(grad_clip_norm=0.05), {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_replay_variants(variant: str) -> None:
    common, engine_only = VARIANTS[variant]
    engine = run_workers(train_engine, 4, topology="ring", steps=STEPS, **common, **engine_only)
    expected = replay(topology_for("ring", 4), STEPS, **common)
    if variant == "clip":  # the clip must bite for the test to mean anything
        unclipped = replay(topology_for("ring", 4), STEPS)
        assert max((x[k] - y[k]).abs().max().item() for x, y in zip(expected, unclipped) for k in x) > 1e-6
    assert max_deviation(engine, expected) <= TOL
