"""How long torch's elastic agent takes to start 4 workers that join a gloo group, all-reduce once and end: each
worker a fresh interpreter that imports torch (what ``launch.launch_workers`` did before 2026-11-29), against
workers forked from a forkserver that imported torch once (``start_method="forkserver"`` with a preload, what it does
now). Both in turns, in one run, each launch in a launcher process of its own that has imported torch already, as
``decent-train`` has (a forkserver outlives its first launch: a second one in the same process starts in about 0.5 s).

    python scripts/bench_worker_start.py [--rounds 3] [--workers 4]

Why: process start-up is most of a short launch on 2 cores, and the slow tests are mostly launches
(scripts/BENCHMARKS.md, "The same machine, slower by half").
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import time

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def work() -> None:
    """What each worker does: join, all-reduce, leave."""
    import torch

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1000))
    dist.destroy_process_group()


def launch(mode: str, workers: int) -> float:
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=f"bench-{mode}", rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                       start_method="forkserver" if mode == "forkserver" else "spawn")
    start = time.monotonic()
    if mode == "forkserver":
        elastic_launch(cfg, work)()
    else:
        elastic_launch(cfg, sys.executable)("-u", __file__, "--work")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--work", action="store_true", help=argparse.SUPPRESS)  # a fresh interpreter's worker
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one launch in this process: prints its wall time
    args = parser.parse_args()
    if args.work:
        work()
        return
    if args.one:
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
        print(launch(args.one, args.workers))
        return
    walls: dict[str, list[float]] = {"interpreters": [], "forkserver": []}
    for _ in range(args.rounds):
        for mode in walls:
            one = subprocess.run([sys.executable, __file__, "--one", mode, "--workers", str(args.workers)],
                                 capture_output=True, text=True, check=True)
            walls[mode].append(float(one.stdout.split()[-1]))
    medians = {mode: statistics.median(values) for mode, values in walls.items()}
    for mode, values in walls.items():
        print(f"{mode:>12}: median {medians[mode]:.1f} s wall  ({', '.join(f'{v:.1f}' for v in values)})")
    print(f"forkserver / interpreters: {medians['forkserver'] / medians['interpreters']:.2f}x")


if __name__ == "__main__":
    main()
