"""Int8 gossip's compiled loops (engine/int8_kernels.py) compute what the eager path computes, bit for bit where
both ends of a pair must agree (the messages and the public copies), and every worker still matches the float64
replay with them (tests/replay.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from decent_train import optim_fn_adam
from decent_train.engine.compress import CompressedGossip, Int8Compressor
from decent_train.engine.int8_kernels import COMPILED_INT8_ENV, Int8Kernels, compiled_int8_kernels
from decent_train.engine.topology import Edge
from tests.distributed import run_workers
from tests.replay import max_deviation, replay_compressed, topology_for, train_engine


def _pair_states(numel: int, dtype: torch.dtype, copy_dtype: torch.dtype | None, compiled: bool
                 ) -> tuple[list[CompressedGossip], Edge, list[torch.Tensor]]:
    """Both ends of a pair (weight 0.3), their copies reset to a common start, and their parameters."""
    edge, compressor = Edge([0, 1], 0.3), Int8Compressor()
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    states = [CompressedGossip.create(compressor, start, [edge], copy_dtype) for _ in range(2)]
    for state in states:
        state.reset(start)
        state.kernels = Int8Kernels(compressor.block, compressor.LEVELS) if compiled else None
    xs = [start + 0.01 * torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)]
    return states, edge, xs


@pytest.mark.parametrize("numel", [4096, 5000])  # whole rows; a partial last row
@pytest.mark.parametrize("dtype, copy_dtype", [(torch.float32, None), (torch.float64, None),
                                               (torch.float32, torch.bfloat16)])
def test_compiled_kernels_match_the_eager_path(numel: int, dtype: torch.dtype, copy_dtype: torch.dtype | None) -> None:
    # In a worker process: on torch 2.13, compiling starts autograd's threads, and later tests fork.
    run_workers(_side_by_side, 1, numel, dtype, copy_dtype, True)


@pytest.mark.parametrize("numel, dtype", [(5000, torch.float32), (4096, torch.float64)])
def test_compiled_mix_into_another_buffer(numel: int, dtype: torch.dtype) -> None:
    """The mix written into a buffer other than the parameters (the outer exchange's staged result; the engine mixes
    in place): the compiled loop once wrote nothing there (inductor drops the write to ``out`` when the levels and
    scales, views of one message, alias each other and ``out`` does not alias ``x``)."""
    run_workers(_side_by_side, 1, numel, dtype, None, False)


def _side_by_side(rank: int, world_size: int, numel: int, dtype: torch.dtype, copy_dtype: torch.dtype | None,
                  in_place: bool) -> None:
    """Four rounds of a pair's exchange, eager and compiled side by side from the same state, each worker's parameters
    moved by noise between rounds, mixed in place or into another buffer. The mix's last adds may round differently
    (x then differs by units in the last place, and so would every later message): the compiled run continues from
    the eager run's parameters."""
    runs = {compiled: _pair_states(numel, dtype, copy_dtype, compiled) for compiled in (False, True)}
    (eager, edge, xs), (compiled, _, compiled_xs) = runs[False], runs[True]
    generator, first = torch.Generator().manual_seed(1), xs[0].clone()
    for _ in range(4):
        for states, values in ((eager, xs), (compiled, compiled_xs)):
            sent = [state.encode(x, edge).clone() for state, x in zip(states, values)]
            for i, state in enumerate(states):
                state.incoming[0].copy_(sent[1 - i])
                out = values[i] if in_place else torch.full_like(values[i], float("nan"))
                state.mix(values[i], out, edge, [state.incoming[0]], 0.8)
                values[i].copy_(out)
        for i in range(2):  # what both ends of a pair must agree on, bit for bit: the messages and the copies
            assert torch.equal(eager[i].incoming[0], compiled[i].incoming[0])
            for name in ("own", "others"):
                held = [getattr(s[i].copies[CompressedGossip.key(edge)], name) for s in (eager, compiled)]
                assert torch.equal(*held), name
            tolerance = 4 * torch.finfo(dtype).eps * xs[i].abs().max()
            assert torch.allclose(xs[i], compiled_xs[i], rtol=0, atol=tolerance)
            compiled_xs[i].copy_(xs[i])
        assert torch.equal(eager[0].copies[CompressedGossip.key(edge)].own,  # rank 0's copy, at both ends
                           eager[1].copies[CompressedGossip.key(edge)].others)
        for x in xs + compiled_xs:
            x.add_(0.001 * torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype))
        compiled_xs[0].copy_(xs[0])
        compiled_xs[1].copy_(xs[1])
    assert not torch.equal(first, xs[0]), "the parameters move: a real test"
    # The compiled loops read and write the parameters, the copies and the messages only: a pair that they encode and
    # mix holds no scratch buffer (a bucket's worth less memory); the eager path made one at its first encode.
    assert all(s.scratch is None for s in compiled) and all(s.scratch is not None for s in eager)


def test_kernels_compile_only_where_they_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COMPILED_INT8_ENV, raising=False)
    assert compiled_int8_kernels(2**20 - 1, 256, 127) is None  # auto: small buckets stay eager
    assert compiled_int8_kernels(2**20, 256, 127) is not None
    monkeypatch.setenv(COMPILED_INT8_ENV, "never")
    assert compiled_int8_kernels(2**24, 256, 127) is None
    monkeypatch.setenv(COMPILED_INT8_ENV, "always")
    assert compiled_int8_kernels(10, 256, 127) is not None
    monkeypatch.setenv(COMPILED_INT8_ENV, "yes")
    with pytest.raises(ValueError, match=r"DECENT_TRAIN_COMPILED_INT8='yes': valid are auto, always, never"):
        compiled_int8_kernels(10, 256, 127)


@pytest.mark.slow
def test_every_worker_matches_the_replay_with_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with the compiled loops in every bucket: 4 workers of ring gossip, int8, Adam, in float64."""
    monkeypatch.setenv(COMPILED_INT8_ENV, "always")
    steps, adam = 12, partial(optim_fn_adam, lr=0.01)
    engine = run_workers(train_engine, 4, topology="ring", steps=steps, optim_fn=adam, compression="int8",
                         consensus_step=0.8)
    expected = replay_compressed(topology_for("ring", 4), steps, Int8Compressor(), engine[0]["buckets"],
                                 optim_fn=adam, consensus_step=0.8)
    assert max_deviation(engine, expected) <= 1e-12
