"""Launch user scripts under torchrun many times, two at a time, and count the launches in which every rank exited 0
(issue 38, acceptance 4: the teardown abort, gloo's "terminate called without an active exception" at interpreter
exit, must not turn a finished run into a failed job).

    python scripts/repeat_launches.py                       # 30 x each script, 2 at a time, 4 ranks each
    python scripts/repeat_launches.py --launches 5 --only localsgd

The scripts: ``tests/user_scripts/own_optimizer.py`` with its front swapped to ``LocalSGD`` (``--front``: the
script as written adopts DiLoCo; ``diloco``, ``localsgd`` and ``gossip`` are each a copy with that front), and
decent-dp's own test script against the engine (``tests/user_scripts/decent_dp_style.py``). Two launches at a time
load the machine (8 ranks on its cores), which is when gloo's worker threads are scheduled late. Not part of the test
suite: it takes minutes. Exit status 1 if any launch failed; each failure's rank, exit status and stderr tail are
printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER_SCRIPTS = REPO / "tests" / "user_scripts"
FRONTS = {  # own_optimizer.py's two lines, per front
    "diloco": ("from decent_train import DiLoCo", "DiLoCo(model, inner, outer,"),
    "localsgd": ("from decent_train import LocalSGD", "LocalSGD(model, inner,"),
    "gossip": ("from decent_train import Gossip", "Gossip(model, inner,"),
}


def front_script(front: str, directory: Path) -> Path:
    """own_optimizer.py adopting ``front`` instead of DiLoCo (Gossip takes no ``sync_every``)."""
    text = (USER_SCRIPTS / "own_optimizer.py").read_text()
    line_import, line_with = FRONTS[front]
    text = text.replace(FRONTS["diloco"][0], line_import).replace(FRONTS["diloco"][1], line_with)
    if front == "gossip":
        text = text.replace("sync_every=args.sync_every, ", "")
    assert line_with in text, f"own_optimizer.py no longer reads as {FRONTS['diloco']}"
    path = directory / f"own_optimizer_{front}.py"
    path.write_text(text)
    return path


def launch(script: Path, ranks: int, log: Path, timeout_s: float, starve: bool) -> tuple[int, str]:
    """One torchrun launch: its exit status, and the end of its output when it failed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        deadline, starved = time.monotonic() + timeout_s, set()
        while proc.poll() is None and time.monotonic() < deadline:
            if starve:
                _starve(proc.pid, starved)
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        code = proc.wait() if time.monotonic() < deadline else -1
    if code == 0:
        return code, ""
    kept = Path(tempfile.gettempdir()) / f"repeat_launches_failed_{os.getpid()}_{log.name}"
    kept.write_text(log.read_text(errors="replace"))  # the whole log: the failing rank's error is above the tail
    return code, "\n".join(log.read_text(errors="replace").splitlines()[-15:]) + f"\n(whole log: {kept})"


def _starve(agent: int, done: set[tuple[int, int]]) -> None:
    """What a loaded machine does to gloo at the worst moment (as tests/test_clean_exit.py does): each worker of
    ``agent`` pinned to one CPU, and gloo's worker threads (``pt_gloo_runloop``) given SCHED_IDLE."""
    cpus = sorted(os.sched_getaffinity(0))
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent:
                continue
            pid = int(entry.name)
            if (pid, 0) not in done:
                os.sched_setaffinity(pid, {cpus[pid % len(cpus)]})
                done.add((pid, 0))
            for tid in map(int, os.listdir(entry / "task")):
                gloo = (entry / "task" / str(tid) / "comm").read_text().strip() == "pt_gloo_runloop"
                if gloo and (pid, tid) not in done:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                    done.add((pid, tid))
        except OSError:  # it exited meanwhile
            continue


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=30, help="launches of each script")
    parser.add_argument("--parallel", type=int, default=2, help="launches running at once")
    parser.add_argument("--ranks", type=int, default=4, help="workers per launch")
    parser.add_argument("--only", choices=[*FRONTS, "engine"], action="append",
                        help="these scripts only (default: localsgd and engine)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--starve", action="store_true",
                        help="pin each worker to a CPU and give gloo's threads SCHED_IDLE (tests/test_clean_exit.py)")
    args = parser.parse_args()
    chosen = args.only or ["localsgd", "engine"]
    with tempfile.TemporaryDirectory(prefix="repeat_launches_") as tmp:
        directory = Path(tmp)
        scripts = {name: (USER_SCRIPTS / "decent_dp_style.py" if name == "engine" else front_script(name, directory))
                   for name in chosen}
        jobs = [(name, i) for i in range(args.launches) for name in chosen]  # interleaved: both under the same load
        passed = dict.fromkeys(chosen, 0)
        failures = []
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            futures = {pool.submit(launch, scripts[name], args.ranks, directory / f"{name}_{i}.log", args.timeout,
                                   args.starve):
                       (name, i) for name, i in jobs}
            for future in concurrent.futures.as_completed(futures):
                name, i = futures[future]
                code, tail = future.result()
                if code == 0:
                    passed[name] += 1
                else:
                    failures.append(f"--- {name} launch {i}: exit {code}\n{tail}")
                print(f"{name} launch {i}: exit {code}", flush=True)
    for failure in failures:
        print(failure)
    summary = ", ".join(f"{name}: {passed[name]}/{args.launches} exit 0" for name in chosen)
    starved = ", gloo threads starved" if args.starve else ""
    print(f"{summary} ({args.parallel} at a time, {args.ranks} ranks each{starved}, {time.monotonic() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
