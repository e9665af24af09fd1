"""The launcher's check of the checkpoint a run resumes from (``launcher/preflight.py: check_resume`` ->
``components/checkpoint.py: verify_checkpoint``), timed on real checkpoints: what a resume (and every SLURM requeue)
waits for before any worker starts, and what a worker then pays to read its own file::

    python scripts/bench_resume_scan.py --before HEAD~1      # the numbers in BENCHMARKS.md
    python scripts/bench_resume_scan.py --quick              # 26M-parameter ranks only

The checkpoints are written by the project's own ``save_checkpoint``, one process writing every rank's file in turn
(ranks N-1..1, then 0, whose gather returns every rank's entry and so writes the manifest as rank 0 of N workers does):
the same files, names and manifest as N workers write. Each rank's state is laid out as ``training/checkpointer.py``
saves it: a GPT-2-shaped ``model`` state dict (float32) and an ``algorithm`` holding an Adam state of ``--moments``
tensors per parameter (AccumAdamW keeps 3: exp_avg, exp_avg_sq, accum_grad), plus the step, the RNG state and so on.

For each size and world size, side by side in one process:

* ``hash``: ``_checksum`` of every rank's file, one after another (what the check did before it was threaded);
* ``scan``: ``torch.load(mmap=True)`` + ``nonfinite_tensor`` of every rank's file (the NaN/inf check);
* ``verify``: the whole ``verify_checkpoint``, this tree's and, with ``--before REV``, ``checkpoint.py`` at ``REV``
  (loaded beside it): their ratio is the change's effect;
* ``read_file``: one worker's ``_read_file`` of its own rank (hash, full ``torch.load``, scan);
* ``load``: a plain ``torch.load`` of rank 0's file, and ``scan1``, the scan of that file alone: the scan's share.

"warm": the files are in the page cache (they are, right after writing; ``fincore`` confirms the cached share).
"cold": every file is dropped from the page cache first (``posix_fadvise(DONTNEED)``, no root needed; the cached share
is printed after the drop): what a requeued job on another node, or after the cache was reused, reads from the disk.
Cold ``hash`` and ``scan`` are timed only for checkpoints of up to ``--cold-parts-gb`` (they read every byte again),
and only those are timed warm ``--repeat`` times (the median; each time is printed); larger ones once.
The checkpoints are deleted after each size.

``--threads`` (torch's intra-op threads) is 1 by default: on a loaded 2-core machine a 2-thread aminmax waits for a
descheduled thread, and the same scan took 0.1 s or 0.9 s from one call to the next; with 1 it is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from decent_train.components import checkpoint as ck  # noqa: E402
from revisions import load_revision  # noqa: E402 - scripts/ (this script's folder)

CHECKPOINT = "decent_train/components/checkpoint.py"
SIZES = {"26M": (320, 8), "124M": (768, 12)}  # GPT-2 shapes (n_embd, n_layer), vocab 50257, context 1024


def gpt2_state(n_embd: int, n_layer: int, moments: int) -> dict[str, Any]:
    """One rank's state as the checkpointer saves it, GPT-2-shaped, float32, with ``moments`` Adam tensors each."""
    d, shapes = n_embd, {"transformer.wte.weight": (50257, n_embd), "transformer.wpe.weight": (1024, n_embd)}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        shapes |= {h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d),
                   h + "attn.c_attn.bias": (3 * d,), h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
                   h + "ln_2.weight": (d,), h + "ln_2.bias": (d,), h + "mlp.c_fc.weight": (d, 4 * d),
                   h + "mlp.c_fc.bias": (4 * d,), h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,)}
    shapes |= {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    generator = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    names = ["exp_avg", "exp_avg_sq", "accum_grad"][:moments]
    optimizer = {i: {"step": torch.tensor(100), **{n: p * 0.01 if n != "exp_avg_sq" else p.square() for n in names}}
                 for i, p in enumerate(model.values())}
    return {"step": 100, "data_position": 800, "batch_size": 8, "model": model,
            "algorithm": {"optimizer": {"state": optimizer, "param_groups": [{"lr": 6e-4, "params": list(optimizer)}]}},
            "rng": torch.get_rng_state(), "cuda_rng": None}


class OneRankAtATime:
    """``torch.distributed`` as ``save_checkpoint`` sees it, for one process writing every rank's file in turn."""

    def __init__(self, world: int) -> None:
        self.world, self.rank, self.entries = world, 0, [{} for _ in range(world)]

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world

    def all_gather_object(self, out: list[Any], entry: Any) -> None:
        self.entries[self.rank] = entry
        out[:] = self.entries  # rank 0 writes last: it sees every rank's entry

    def barrier(self) -> None:
        pass


def write(run_dir: Path, world: int, state: dict[str, Any]) -> Path:
    """``world`` ranks' checkpoint of ``state`` (each rank's a little different) through ``save_checkpoint``."""
    shim, real = OneRankAtATime(world), ck.dist
    ck.dist = shim  # type: ignore[assignment]
    try:
        for rank in [*range(1, world), 0]:
            shim.rank = rank
            state["model"]["transformer.ln_f.bias"].fill_(rank)
            directory = ck.save_checkpoint(run_dir, 100, state, "ring", {"name": "gpt2"}, keep=1)
    finally:
        ck.dist = real  # type: ignore[assignment]
    return directory


def drop_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (clean pages: ``save_checkpoint`` fsyncs what it writes)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_share(paths: list[Path]) -> float:
    """The share of ``paths``' bytes in the page cache (``fincore``), or NaN without it."""
    if shutil.which("fincore") is None:
        return float("nan")
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *map(str, paths)],
                         check=True, capture_output=True, text=True).stdout.split()
    return sum(map(int, out[0::2])) / max(1, sum(map(int, out[1::2])))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def scan(path: Path) -> str:
    """The NaN/inf check of one file as ``verify_checkpoint`` does it: mapped, one aminmax per tensor."""
    return ck._nonfinite_file(path, ck.torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def measure(label: str, checkpoint: ck.Checkpoint, before: ModuleType | None, cold_parts: bool, repeat: int,
            rows: list[dict[str, Any]]) -> None:
    """Time each part on ``checkpoint`` warm (``repeat`` times: the median), then cold (once); append rows (label,
    part, cache, s, GB, GB/s). Each part returns what it found wrong: nothing, asserted."""
    files = [checkpoint.path / e["file"] for e in checkpoint.manifest["ranks"]]
    total = sum(p.stat().st_size for p in files) / 1e9
    one = files[0].stat().st_size / 1e9
    parts: list[tuple[str, float, Callable[[], Any], bool]] = [
        ("hash", total, lambda: "".join(str(p) if sha != e["sha256"] else "" for p, e, (sha, _) in
                                        zip(files, checkpoint.manifest["ranks"], map(ck._checksum, files))),
         cold_parts),
        ("scan", total, lambda: "".join(scan(p) for p in files), cold_parts),
        ("verify", total, lambda: ck.verify_checkpoint(checkpoint), True),
    ]
    if before is not None:
        old = before.Checkpoint(checkpoint.path, checkpoint.manifest)
        parts.append(("verify before", total, lambda: before.verify_checkpoint(old), True))
    parts += [
        ("read_file", one, lambda: ck._read_file(checkpoint, 0)[1], True),
        ("load", one, lambda: "" if ck.torch.load(files[0], map_location="cpu", weights_only=True) else "empty",
         False),
        ("scan1", one, lambda: scan(files[0]), False),
    ]
    times: dict[tuple[str, str], list[float]] = {}
    shares: dict[tuple[str, str], float] = {}
    for cache, rounds in (("warm", repeat), ("cold", 1)):
        for _ in range(rounds):  # the parts interleaved: a load that comes and goes hits each alike
            for part, gb, fn, cold_too in parts:
                if cache == "cold" and not cold_too:
                    continue
                if cache == "cold":
                    drop_cache(files)
                shares[part, cache] = min(shares.get((part, cache), 1.0), cached_share(files if gb == total
                                                                                       else files[:1]))
                seconds, result = timed(fn)
                assert result == "", (part, result)  # every part finds the checkpoint sound
                times.setdefault((part, cache), []).append(seconds)
        for part, gb, _, _ in parts:
            if (part, cache) not in times:
                continue
            seconds = statistics.median(times[part, cache])
            share, each = shares[part, cache], times[part, cache]
            rows.append({"config": label, "part": part, "cache": cache, "cached_before": round(share, 3),
                         "seconds": round(seconds, 3), "each": [round(t, 3) for t in each], "GB": round(gb, 3),
                         "GB_per_s": round(gb / seconds, 3)})
            print(f"{label:>9} {part:>13} {cache}  cached {share:6.1%}  median {seconds:7.3f} s  {gb:6.3f} GB "
                  f"{gb / seconds:6.3f} GB/s  each {' '.join(f'{t:.3f}' for t in each)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0])
    parser.add_argument("--sizes", default="26M,124M", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--worlds", default="2,8", help="world sizes (rank files per checkpoint)")
    parser.add_argument("--skip", default="124Mx2", help="size x world pairs left out (disk time), comma-separated")
    parser.add_argument("--moments", type=int, default=2, choices=(2, 3), help="Adam tensors per parameter")
    parser.add_argument("--before", help="git revision whose checkpoint.py is timed beside this tree's")
    parser.add_argument("--cold-parts-gb", type=float, default=3.0, help="cold hash/scan up to this checkpoint size")
    parser.add_argument("--repeat", type=int, default=3, help="warm rounds up to --cold-parts-gb (else 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module docstring)")
    parser.add_argument("--quick", action="store_true", help="26M-parameter ranks only")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where checkpoints are written")
    parser.add_argument("--out", type=Path, help="JSON of every row")
    args = parser.parse_args()
    sizes = ["26M"] if args.quick else args.sizes.split(",")
    before = load_revision(args.before, CHECKPOINT) if args.before else None
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} intra-op threads, "
          f"load average {os.getloadavg()}, checkpoints in {args.dir}", flush=True)
    rows: list[dict[str, Any]] = []
    for size in sizes:
        state = gpt2_state(*SIZES[size], args.moments)
        params = sum(t.numel() for t in state["model"].values())
        for world in map(int, args.worlds.split(",")):
            label = f"{size}x{world}"
            if label in args.skip.split(","):
                continue
            run_dir = Path(tempfile.mkdtemp(prefix="bench_resume_scan_", dir=args.dir))
            try:
                seconds, directory = timed(lambda: write(run_dir, world, state))
                checkpoint = ck.Checkpoint(directory, json.loads((directory / ck.MANIFEST).read_text()))
                gb = sum(e["bytes"] for e in checkpoint.manifest["ranks"]) / 1e9
                print(f"{label}: {params / 1e6:.1f}M parameters x {1 + args.moments} tensors a rank, {world} files, "
                      f"{gb:.3f} GB, written (save_checkpoint, fsync) in {seconds:.1f} s", flush=True)
                rows.append({"config": label, "part": "write", "cache": "-", "seconds": round(seconds, 3),
                             "GB": round(gb, 3), "GB_per_s": round(gb / seconds, 3), "params": params})
                small = gb <= args.cold_parts_gb
                measure(label, checkpoint, before, small, args.repeat if small else 1, rows)
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        del state
    print(f"load average at the end {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
