"""Wall time of whole ``decent-train`` launches from two checkouts of this repository, in turns, in one run: what a
change to the launch costs or saves, end to end (start-up, training, evaluation, exit).

    git worktree add /tmp/before <commit>
    python scripts/bench_launch.py [--rounds 3] /tmp/before . [-- steps=40 eval_every=20]  (options first)

Each launch runs the command (default: the default job shortened to 40 steps) with that checkout first on
``PYTHONPATH``, in a run directory of its own, and must exit 0. Prints each checkout's median wall time and the ratio
of the second to the first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_OVERRIDES = ["steps=40", "eval_every=20"]


def launch(checkout: Path, overrides: list[str], run_dir: Path) -> float:
    command = shutil.which("decent-train") or sys.exit("decent-train is not on PATH (pip install -e .)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    done = subprocess.run([command, *overrides, f"hydra.run.dir={run_dir}"], env=env, cwd=run_dir.parent,
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"{checkout}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a checkout of this repository (the baseline)")
    parser.add_argument("second", type=Path, help="another checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*", default=DEFAULT_OVERRIDES, help="after --: the command's overrides")
    args = parser.parse_args()
    checkouts = [args.first.resolve(), args.second.resolve()]
    walls: dict[Path, list[float]] = {c: [] for c in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for index, checkout in enumerate(checkouts):
                walls[checkout].append(launch(checkout, args.overrides, Path(tmp) / f"run{round_}-{index}"))
    medians = [statistics.median(walls[c]) for c in checkouts]
    for checkout, median in zip(checkouts, medians):
        print(f"{str(checkout):>40}: median {median:.1f} s wall ({', '.join(f'{w:.1f}' for w in walls[checkout])})")
    print(f"second / first: {medians[1] / medians[0]:.2f}x  (decent-train {' '.join(args.overrides)})")


if __name__ == "__main__":
    main()
