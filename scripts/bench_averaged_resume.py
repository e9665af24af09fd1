"""An averaged resume (M workers continuing N workers' checkpoint, ``components/checkpoint.py:
load_latest_checkpoint``), timed with this tree's code and, beside it in the same workers, ``checkpoint.py`` at
``--before REV``::

    python scripts/bench_averaged_resume.py --before 1b052fb     # the numbers in BENCHMARKS.md

The checkpoint is written once by ``bench_resume_scan.write`` (GPT-2-shaped ranks with AccumAdamW's three moments,
each rank's a little different). M gloo workers (spawned, one torch thread each) then load it ``--rounds`` times per
version, the versions alternating, a barrier before each load: a round's time is the slowest worker's. Reported per M:
the median time of each version, their ratio, and how many times the workers opened a rank file in one load (Python's
audit events), summed over the workers. The files stay in the page cache (warm): a cold or shared file system pays
more for each read that the change saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_resume_scan import SIZES, gpt2_state, write  # noqa: E402 - scripts/ (this script's folder)
from revisions import load_revision  # noqa: E402

from decent_train.components import checkpoint as after  # noqa: E402

CHECKPOINT = "decent_train/components/checkpoint.py"


def _worker(rank: int, world: int, run_dir: str, store_path: str, before_rev: str, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    versions = {"after": after, "before": load_revision(before_rev, CHECKPOINT)}
    opened = [0]

    def record(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, Path)) and Path(args[0]).name.startswith("rank"):
            opened[0] += 1

    sys.addaudithook(record)
    times: dict[str, list[float]] = {name: [] for name in versions}
    opens: dict[str, int] = {}
    for round_ in range(rounds):
        for name in (list(versions) if round_ % 2 == 0 else list(reversed(versions))):
            dist.barrier()
            opened[0] = 0
            start = time.perf_counter()
            checkpoint, state = versions[name].load_latest_checkpoint([Path(run_dir)], "ring", {"name": "gpt2"})
            elapsed = torch.tensor([time.perf_counter() - start, float(opened[0])], dtype=torch.float64)
            assert checkpoint is not None and state is not None and state["averaged_from"] != world
            del state
            slowest, total = elapsed.clone(), elapsed.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
            times[name].append(slowest[0].item())
            opens[name] = int(total[1].item())
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "opens": opens}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the revision of checkpoint.py to compare with")
    parser.add_argument("--size", choices=list(SIZES), default="26M")
    parser.add_argument("--saved", type=int, default=8, help="N: the workers that wrote the checkpoint")
    parser.add_argument("--workers", default="2,4", help="M: the workers that load it, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder) / "run"
        write(run_dir, args.saved, gpt2_state(*SIZES[args.size], moments=3))
        gb = sum(f.stat().st_size for f in run_dir.rglob("rank*.pt")) / 1e9
        print(f"{args.size} x {args.saved} ranks, {gb:.3f} GB; torch {torch.__version__}, {os.cpu_count()} cores")
        print("| M | before s | after s | after / before | rank files opened, before -> after |")
        print("|---|---|---|---|---|")
        for world in [int(w) for w in args.workers.split(",")]:
            out = Path(folder) / f"result{world}.json"
            mp.start_processes(_worker, args=(world, str(run_dir), str(Path(folder) / f"store{world}"), args.before,
                                              args.rounds, str(out)), nprocs=world, start_method="spawn")
            result = json.loads(out.read_text())
            before, now = (statistics.median(result["times"][k]) for k in ("before", "after"))
            print(f"| {world} | {before:.2f} | {now:.2f} | {now / before:.2f} | "
                  f"{result['opens']['before']} -> {result['opens']['after']} |  rounds: {result['times']}")


if __name__ == "__main__":
    main()
