"""Compressed gossip (engine/exchange.py): the workers' mean is preserved and they reach consensus; every worker
matches an independent float64 replay of the scheme; naive compression of the parameters fails the same test;
checkpoints resume bit-exactly; the compressors' messages and errors."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytest
import torch

from decent_train import DecentralizedDataParallel, optim_fn_adam, optim_fn_sgd
from decent_train.engine.compress import BFloat16Compressor, CompressedGossip, Int8Compressor, make_compressor
from tests.distributed import run_workers
from tests.replay import (
    batch,
    make_model,
    max_deviation,
    replay_compressed,
    round_trip,
    topology_for,
    train_engine,
)

FROZEN = partial(optim_fn_sgd, lr=0.0, momentum=0.0, weight_decay=0.0)  # pure gossip: the optimizer never moves x


def _gossip_perturbed(rank: int, world_size: int, topology: str, compression: str, steps: int,
                      naive: bool = False, local_world_size: int = 1, **engine_kwargs: Any) -> dict[str, Any]:
    """Wrap, then move every worker's parameters by its own noise; ``steps`` steps of pure gossip."""
    from loguru import logger

    logger.remove()
    ddp = DecentralizedDataParallel(make_model(0), FROZEN, topology=topology, bucket_size_in_mb=0.0005,
                                    compression=None if naive else compression, local_world_size=local_world_size,
                                    **engine_kwargs)
    if naive:  # the receiver mixes Q(x_j) while the sender keeps x_j: a test helper, never an engine option
        compressor, mix = make_compressor(compression), ddp._mode.mix

        def naive_mix(bucket: Any) -> None:
            if bucket.pending is not None:
                ddp._context.complete_pending(bucket)
                bucket.comm.copy_(round_trip(compressor, bucket.comm))
            mix(bucket)

        ddp._mode.mix = naive_mix
    generator = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    start = [p.detach().clone() for p in ddp.parameters()]
    for step in range(steps):
        x, y = batch(rank, step)
        ((ddp(x) - y) ** 2).mean().backward()
    in_flight = ddp._mode.round_of(ddp.step_count)  # its own copies moved at launch, its peer's at the next mix
    pairs = {}  # each settled pair round's peer and copies (own, others), by bucket
    for r, stages in enumerate(ddp._mode.my_stages):
        if not naive and stages[0].size == 2 and r != in_flight:
            held = [b.compressed.copies[CompressedGossip.key(stages[0])] for b in ddp._buckets]
            peer = next(j for j in stages[0].ranks if j != rank)
            pairs[r] = (peer, [(c.own.clone(), c.others.clone()) for c in held])
    return {"start": start, "end": [p.detach().clone() for p in ddp.parameters()], "pairs": pairs}


def _mean_shift_and_consensus(results: list[dict[str, Any]]) -> tuple[float, float]:
    """(largest relative move of the workers' mean, consensus distance at the end / at the start)."""
    n = len(results)
    means = {
        key: [sum(r[key][k] for r in results) / n for k in range(len(results[0][key]))] for key in ("start", "end")
    }
    shift = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(means["start"], means["end"]))

    def distance(key: str) -> float:
        return math.sqrt(sum(((r[key][k] - m) ** 2).sum().item() for r in results for k, m in enumerate(means[key])))

    return shift, distance("end") / distance("start")


@pytest.mark.parametrize("compression", ["int8", "bf16"])
@pytest.mark.parametrize(
    "topology, world_size, local_world_size",
    [("ring", 4, 1), ("one-peer-exp", 4, 1), ("ring", 3, 1), ("complete", 4, 1), ("hierarchical", 4, 2)],
)
def test_compressed_gossip_preserves_the_mean_and_reaches_consensus(
    topology: str, world_size: int, local_world_size: int, compression: str
) -> None:
    """Pure gossip (lr 0) from different parameters on every worker, in float64; hierarchical: 2 nodes x 2 workers,
    rounds of two stages."""
    results = run_workers(_gossip_perturbed, world_size, topology=topology, compression=compression, steps=150,
                          local_world_size=local_world_size)
    shift, consensus = _mean_shift_and_consensus(results)
    assert shift <= 1e-12
    assert consensus < 1e-4


@pytest.mark.parametrize("compression", ["int8", "bf16"])
def test_naive_compression_of_the_parameters_moves_the_mean(compression: str) -> None:
    """The oracle above catches the biased scheme: mixing Q(x_j) moves the mean by the compression error of |x|."""
    results = run_workers(_gossip_perturbed, 4, topology="ring", compression=compression, steps=150, naive=True)
    shift, _ = _mean_shift_and_consensus(results)
    assert shift > 1e-6


@pytest.mark.parametrize("compression, copies", [("int8", None), ("bf16", None), ("int8", torch.bfloat16)])
@pytest.mark.parametrize("topology, world_size", [("ring", 4), ("one-peer-exp", 8)])
def test_every_worker_matches_the_compressed_replay(
    topology: str, world_size: int, compression: str, copies: torch.dtype | None
) -> None:
    steps, adam = 12, partial(optim_fn_adam, lr=0.01)
    engine = run_workers(train_engine, world_size, topology=topology, steps=steps, optim_fn=adam,
                         compression=compression, consensus_step=0.8, public_copy_dtype=copies)
    buckets = engine[0]["buckets"]
    assert len(buckets) >= 3, "the test model must span several buckets"
    expected = replay_compressed(topology_for(topology, world_size), steps, make_compressor(compression), buckets,
                                 optim_fn=adam, consensus_step=0.8, pair_copy_dtype=copies)
    assert max_deviation(engine, expected) <= 1e-12
    if copies is not None:
        full = replay_compressed(topology_for(topology, world_size), steps, make_compressor(compression), buckets,
                                 optim_fn=adam, consensus_step=0.8)
        assert max_deviation(engine, full) > 1e-9, "the replay tells bfloat16 copies from float64 ones"
    uncompressed = run_workers(train_engine, world_size, topology=topology, steps=steps, optim_fn=adam)
    assert max_deviation(uncompressed, expected) > 1e-9, "the replay tells compressed from plain gossip"


@pytest.mark.parametrize("topology", ["ring", "one-peer-exp"])
def test_bfloat16_public_copies_keep_the_mean_and_are_identical_at_both_ends(topology: str) -> None:
    """``public_copy_dtype=torch.bfloat16``: half the copies' memory. Both ends of a pair hold the same copy bit for
    bit, so the mean stays exact; the workers agree only to bfloat16's precision (the documented floor)."""
    results = run_workers(_gossip_perturbed, 4, topology=topology, compression="int8", steps=150,
                          public_copy_dtype=torch.bfloat16)
    shift, consensus = _mean_shift_and_consensus(results)
    assert shift <= 1e-12
    assert all(result["pairs"] for result in results)
    for result in results:
        for r, (peer, copies) in result["pairs"].items():
            theirs = results[peer]["pairs"][r][1]
            for (own, others), (peer_own, peer_others) in zip(copies, theirs):
                assert own.dtype == others.dtype == torch.bfloat16
                assert torch.equal(own, peer_others) and torch.equal(others, peer_own)
    size = math.sqrt(sum((p ** 2).sum().item() for r in results for p in r["end"]))
    spread = consensus * math.sqrt(sum(((a - b) ** 2).sum().item() for r in results
                                       for a, b in zip(r["start"], results[0]["start"])))
    assert spread <= 2**-8 * size, "the workers agree to bfloat16's precision of the parameters"
    full = run_workers(_gossip_perturbed, 4, topology=topology, compression="int8", steps=150)
    assert _mean_shift_and_consensus(full)[1] < consensus, "float copies go further: the floor is bfloat16's"


def _resume(rank: int, world_size: int, stop_at: int | None, steps: int, path: str) -> dict[str, torch.Tensor]:
    from loguru import logger

    logger.remove()

    def make() -> DecentralizedDataParallel:
        return DecentralizedDataParallel(make_model(0).float(), partial(optim_fn_adam, lr=0.01), topology="ring",
                                         bucket_size_in_mb=0.0005, compression="int8")

    ddp, start = make(), 0
    if stop_at is not None:
        for step in range(stop_at):
            x, y = batch(rank, step)
            ((ddp(x.float()) - y.float()) ** 2).mean().backward()
        torch.save({"model": ddp.state_dict(), "engine": ddp.engine_state_dict()}, f"{path}.{rank}")
        ddp, start = make(), stop_at
        saved = torch.load(f"{path}.{rank}", weights_only=False)
        ddp.load_state_dict(saved["model"])
        ddp.load_engine_state_dict(saved["engine"])
    for step in range(start, steps):
        x, y = batch(rank, step)
        ((ddp(x.float()) - y.float()) ** 2).mean().backward()
    return {k: v.detach().clone() for k, v in ddp.named_parameters()}


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    whole = run_workers(_resume, 4, stop_at=None, steps=9, path=path)
    resumed = run_workers(_resume, 4, stop_at=5, steps=9, path=path)
    for a, b in zip(whole, resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(whole[0][k], whole[1][k]) for k in whole[0]), "the workers differ: a real test"


def test_int8_messages_are_a_quarter_of_float32_and_round_to_the_nearest_level() -> None:
    compressor = Int8Compressor(block=256)
    numel = 1000
    assert compressor.message_bytes(numel) == 1024 + 4 * 4  # padded levels, one float32 scale per block
    assert compressor.message_bytes(2**20) / (4 * 2**20) == pytest.approx((1 + 4 / 256) / 4)
    difference = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    difference[256:512] = 0.0  # a block of zeros: scale 0, no division by zero
    scratch = torch.zeros(compressor.padded_numel(numel), dtype=torch.float64)
    scratch[:numel] = difference
    message = torch.empty(compressor.message_bytes(numel), dtype=torch.uint8)
    compressor.encode_(scratch, message)
    received = torch.empty_like(scratch)
    compressor.decode(message, received)
    assert torch.equal(received, scratch)  # the sender's copy moves by exactly what a receiver decodes
    blocks = difference.new_zeros(compressor.padded_numel(numel))
    blocks[:numel] = difference
    scale = blocks.view(-1, 256).abs().amax(1).float().double() / 127  # by hand: absmax / 127 per block
    error = (received - blocks).view(-1, 256).abs()
    assert torch.all(error <= scale.unsqueeze(1) / 2 * (1 + 1e-6))
    assert torch.all(received[256:512] == 0)
    levels = message[: compressor.padded_numel(numel)].view(torch.int8)
    assert levels.abs().max() == 127 and levels.min() >= -127  # every block's largest |d| maps to +-127, none beyond
    assert BFloat16Compressor().message_bytes(numel) == 2 * numel


def test_compressed_buckets_hold_no_float_receive_buffer() -> None:
    """Compressed gossip receives into its messages (a quarter of the bucket with int8): no float ``comm`` copy (at
    world size one, where nothing is received, neither has plain gossip; two workers: tests/test_engine_buffers.py)."""
    int8 = DecentralizedDataParallel(make_model(0), FROZEN, topology="ring", bucket_size_in_mb=0.0005,
                                     compression="int8")
    assert sum(b.comm.numel() for b in int8._buckets) == 0
    assert int8.message_bytes == [Int8Compressor().message_bytes(b.flat.numel()) for b in int8._buckets]


def test_a_wrong_compression_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"compression='int4': valid are none, bf16, int8"):
        DecentralizedDataParallel(make_model(0), FROZEN, topology="ring", compression="int4")
    with pytest.raises(ValueError, match=r"consensus_step must be in \(0, 1\], got 0"):
        DecentralizedDataParallel(make_model(0), FROZEN, topology="ring", compression="int8", consensus_step=0)


def _gossip_with_switches(rank: int, world_size: int, compression: str) -> dict[str, Any]:
    """Pure gossip from perturbed parameters through switch_to (a new topology's copies start at zero), an exact
    global average (copies reset to it) and the all-reduce mode and back."""
    from loguru import logger

    logger.remove()
    ddp = DecentralizedDataParallel(make_model(0), FROZEN, topology="ring", bucket_size_in_mb=0.0005,
                                    compression=compression)
    generator = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for p in ddp.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
    start = [p.detach().clone() for p in ddp.parameters()]
    snapshots = {}
    for step in range(120):
        if step == 30:
            ddp.switch_to("one-peer-exp")
        if step == 60:
            ddp.global_avg(will_revert=False)
            snapshots["averaged"] = [p.detach().clone() for p in ddp.parameters()]
            with torch.no_grad():  # leave the average again, differently on every worker
                for p in ddp.parameters():
                    p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype))
            snapshots["restart"] = [p.detach().clone() for p in ddp.parameters()]
        if step == 90:
            snapshots["before_allreduce"] = [p.detach().clone() for p in ddp.parameters()]
            ddp.switch_to("allreduce")
        if step == 95:
            ddp.switch_to("complete")
        x, y = batch(rank, step)
        ((ddp(x) - y) ** 2).mean().backward()
    return {"start": start, "end": [p.detach().clone() for p in ddp.parameters()], **snapshots,
            "compressed": ddp.compressed}


@pytest.mark.parametrize("compression", ["int8", "bf16"])
def test_switches_and_global_averages_keep_the_copies_consistent(compression: str) -> None:
    results = run_workers(_gossip_with_switches, 4, compression=compression)
    assert all(r["compressed"] for r in results)  # gossip again after the all-reduce phase, compressed
    for r in results[1:]:  # global_avg(will_revert=False): every worker at the same average
        assert all(torch.equal(a, b) for a, b in zip(r["averaged"], results[0]["averaged"]))
    first, _ = _mean_shift_and_consensus([{"start": r["start"], "end": r["averaged"]} for r in results])
    assert first <= 1e-12  # 60 steps over ring, then one-peer-exp from zero copies: the mean never moved
    shift, consensus = _mean_shift_and_consensus(
        [{"start": r["restart"], "end": r["before_allreduce"]} for r in results]
    )
    assert shift <= 1e-12 and consensus < 1e-4  # one-peer-exp from copies reset to the average
    shift, _ = _mean_shift_and_consensus([{"start": r["restart"], "end": r["end"]} for r in results])
    assert shift <= 1e-12  # through the all-reduce phase and complete's fresh copies too


def _copy_bytes(rank: int, world_size: int, topology: str, local_world_size: int, dtype: torch.dtype | None) -> float:
    """The public copies' bytes per byte of parameters."""
    from loguru import logger

    logger.remove()
    ddp = DecentralizedDataParallel(make_model(0), FROZEN, topology=topology, compression="int8",
                                    local_world_size=local_world_size, public_copy_dtype=dtype)
    held = sum(t.numel() * t.element_size() for b in ddp._buckets for c in b.compressed.copies.values()
               for t in (c.own, c.others))
    return held / sum(b.flat.numel() * b.flat.element_size() for b in ddp._buckets)


@pytest.mark.parametrize(
    "topology, world_size, local_world_size, dtype, copies",
    [
        ("ring", 4, 1, None, 4),  # two pairs: two copies each
        ("ring", 3, 1, None, 2),  # the triple of both rounds: one pair of copies
        ("hierarchical", 8, 2, None, 6),  # a pair in each of the two rounds, and the node's pair in both
        ("ring", 4, 1, torch.bfloat16, 1),  # bfloat16 copies of float64 parameters: a quarter each
        ("hierarchical", 8, 4, torch.bfloat16, 2.5),  # a bfloat16 pair; the node's group of 4 in float64
    ],
)
def test_public_copies_cost_two_per_distinct_group(
    topology: str, world_size: int, local_world_size: int, dtype: torch.dtype | None, copies: float
) -> None:
    """The memory the docs state: two copies per distinct group a worker is in, a pair's in ``public_copy_dtype``."""
    assert run_workers(_copy_bytes, world_size, topology=topology, local_world_size=local_world_size,
                       dtype=dtype) == [copies] * world_size
