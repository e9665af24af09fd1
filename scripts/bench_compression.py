"""How the compressors trade bytes, accuracy of the gossip and CPU time: the measurement behind int8's defaults.

    python scripts/bench_compression.py [--workers 8] [--numel 1048576] [--steps 20] [--blocks 64,256,1024,4096]

One process simulates compressed ring gossip (engine/exchange.py's CompressedGossip, the engine's own update) among
``workers`` workers whose float32 parameters start at different random points, with no training: the consensus
distance should fall as fast as uncompressed gossip's, until the compressor's error stops it. The starting points
have scales as varied as a network's (log-uniform over 1e-4..1, per 100 elements), which is where the block size
matters: one scale per block resolves the small values of a block only as well as its largest allows. For each
compressor it prints the message size relative to float32, the consensus distance relative to its start after
``steps`` steps (and uncompressed gossip's), and the time to encode and to decode-and-add one message per million
elements on one thread. ``int8-stochastic`` rounds up with probability equal to the fraction (seeded), for
comparison with the built-in round-to-nearest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decent_train.engine.compress import (  # noqa: E402
    BFloat16Compressor,
    CompressedGossip,
    Compressor,
    Int8Compressor,
)
from decent_train.engine.topology import Edge  # noqa: E402


class StochasticInt8(Int8Compressor):
    """Int8 with seeded stochastic rounding (unbiased levels), for comparison only."""

    name = "int8-stochastic"

    def __init__(self, block: int, seed: int = 0):
        super().__init__(block)
        self.generator = torch.Generator().manual_seed(seed)

    def _round_(self, rows: Tensor) -> None:
        rows.add_(torch.rand(rows.shape, generator=self.generator, dtype=rows.dtype)).floor_().clamp_(-127, 127)


def ring_pairs(step: int, workers: int) -> list[tuple[int, int]]:
    """decent_train's ring on an even number of workers: (0,1),(2,3),... then (1,2),...,(n-1,0)."""
    shift = step % 2
    return [((2 * k + shift) % workers, (2 * k + 1 + shift) % workers) for k in range(workers // 2)]


def consensus(xs: list[Tensor]) -> float:
    mean = torch.stack(xs).mean(0)
    return float(sum(((x - mean) ** 2).sum() for x in xs).sqrt())


def gossip(compressor: Compressor | None, workers: int, numel: int, steps: int) -> float:
    """Consensus distance after ``steps`` steps relative to the start (copies per round start at zero)."""
    generator = torch.Generator().manual_seed(1)
    # Scales as varied as a network's: every 100 elements their own, log-uniform over 1e-4..1.
    scales = 10 ** (-4 * torch.rand(-(-numel // 100), generator=generator)).repeat_interleave(100)[:numel]
    xs = [torch.randn(numel, generator=generator) * scales for _ in range(workers)]
    start = consensus(xs)
    if compressor is None:
        for step in range(steps):
            for i, j in ring_pairs(step, workers):
                xs[i] = xs[j] = (xs[i] + xs[j]) / 2
        return consensus(xs) / start
    edges = [{i: Edge(list(p)) for p in ring_pairs(r, workers) for i in p} for r in range(2)]  # by round, worker
    states = [CompressedGossip.create(compressor, xs[i], [edges[r][i] for r in range(2)], None) for i in range(workers)]
    for state in states:
        state.reset(None)
    for step in range(steps):
        pairs, edge = ring_pairs(step, workers), edges[step % 2]
        messages = [states[i].encode(xs[i], edge[i]).clone() for i in range(workers)]
        for i, j in pairs:
            for me, peer in ((i, j), (j, i)):
                states[me].mix(xs[me], xs[me], edge[me], [messages[peer]], 1.0)
    return consensus(xs) / start


def seconds_per_million(compressor: Compressor, numel: int, repeats: int = 10) -> tuple[float, float]:
    """(encode, decode and add) seconds per million elements on one thread."""
    x = torch.randn(numel)
    pair = Edge([0, 1])
    state = CompressedGossip.create(compressor, x, [pair], None)
    state.reset(None)
    message = state.encode(x, pair).clone()
    start = time.perf_counter()
    for _ in range(repeats):
        state.encode(x, pair)
    encode = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        state.mix(x, x, pair, [message], 0.0)
    mix = (time.perf_counter() - start) / repeats
    return encode * 1e6 / numel, mix * 1e6 / numel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--blocks", default="64,256,1024,4096")
    args = p.parse_args()
    if args.workers < 2 or args.workers % 2:
        sys.exit(f"bench_compression.py: --workers {args.workers}: an even number >= 2")
    torch.set_num_threads(1)
    compressors: list[Compressor] = [BFloat16Compressor()]
    for block in (int(b) for b in args.blocks.split(",")):
        compressors += [Int8Compressor(block), StochasticInt8(block)]
    plain = gossip(None, args.workers, args.numel, args.steps)
    print(f"ring gossip, {args.workers} workers, {args.numel} float32 elements, {args.steps} steps, 1 thread")
    print(f"{'compressor':<26} {'bytes vs fp32':>13} {'consensus':>10} {'encode ms/M':>12} {'mix ms/M':>9}")
    print(f"{'none':<26} {1.0:>13.4f} {plain:>10.2e} {'-':>12} {'-':>9}")
    for compressor in compressors:
        label = compressor.name + (f" block {compressor.block}" if isinstance(compressor, Int8Compressor) else "")
        ratio = compressor.message_bytes(args.numel) / (4 * args.numel)
        reached = gossip(compressor, args.workers, args.numel, args.steps)
        encode, mix = seconds_per_million(compressor, args.numel)
        print(f"{label:<26} {ratio:>13.4f} {reached:>10.2e} {1e3 * encode:>12.2f} {1e3 * mix:>9.2f}")


if __name__ == "__main__":
    main()
