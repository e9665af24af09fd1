"""Time lost per worker failure: live membership (``fault_tolerance=live``) against torchrun's checkpoint-restart
(``fault_tolerance=none``), on the default job (``decent-train steps=1200 checkpoint.every=100``, 4 CPU workers).

    python scripts/bench_fault_tolerance.py --repeats 3 --out bench/fault_tolerance.json
    python scripts/bench_fault_tolerance.py --from bench/fault_tolerance.json   # the table again, from the runs

Six variants, each a real ``decent-train`` job, alternated in rounds (each round rotates their order) so that the
machine's noise hits all alike:

- ``none``: uninterrupted, ``fault_tolerance=none`` (the baseline of ``restart``);
- ``restart``: ``launch.max_restarts=1``, worker rank 2 SIGKILLed (found in /proc, as tests/test_checkpoint.py does)
  once metrics.jsonl reaches ``--at`` (250): torchrun restarts all workers from the newest checkpoint (200);
- ``live-base``: uninterrupted, ``fault_tolerance=live fault_tolerance.detect_s=2`` (``--detect-s``; the baseline of
  the live ones; against ``none`` it is the live path's own overhead);
- ``live-kill``: as live-base, member 2 (its pid from RUN_DIR/workers.json) SIGKILLed at ``--at``, no replacement;
- ``live-replace``: as live-kill plus ``launch.max_restarts=1``: a replacement joins and heals from a live member;
- ``live-hang``: as live-kill but SIGSTOP: the supervisor declares it dead after 2 s without a heartbeat.

Per run: the seconds from the launch to rank 0's result.json (``to_result_s``: training, evaluations, checkpoints
and any restart, not the workers' exit), the launcher's wall time (result.json's ``wall_time_s``, only when the
launcher succeeds) and the subprocess's, eval/accuracy, the step the signal was sent at, and for live runs
result.json's ``membership_changes`` (recovery_s, heal_mb, heal_s). Time lost per failure: a variant's seconds minus
its baseline's in the same round, median and range over the rounds (``lost_s`` from to_result_s, ``lost_wall_s``
from wall_time_s where both runs succeeded). Steps trained twice: rank 0's log (logs/rank0.log, live:
logs/member0.log) has a line per record, kept by every attempt (metrics.jsonl drops the records a restart redoes):
the steps repeated are the last step it recorded before the restart minus ``resumed_from_step``; a live run's
steps must strictly increase (there and in metrics.jsonl).

On a shared machine the wall times of two runs differ by seconds of noise, so each run also measures its own stall
from the timestamps of rank 0's records (every 10 steps), in seconds beyond the run's median seconds per step:
after a restart, from the last record before it to the first record of a step beyond it; in a live run, the excess
of the two record intervals ending at and just after each membership change's step (the loss, and the join of a
replacement): the detection, the reconfiguration and any heal. A run whose launcher fails after rank 0 wrote
result.json (the workers' exit) is measured and the table says that the launcher failed; one that never wrote it
is a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

COMMAND = Path(sys.executable).parent / "decent-train"
JOB = ["steps=1200", "checkpoint.every=100", "logger.progress_bar=false"]
LIVE = ["fault_tolerance=live"]  # and fault_tolerance.detect_s=--detect-s (2)
# name: (overrides, signal sent to rank/member 2 or None, the baseline it is compared with)
VARIANTS: dict[str, tuple[list[str], str | None, str | None]] = {
    "none": ([], None, None),
    "restart": (["launch.max_restarts=1"], "SIGKILL", "none"),
    "live-base": (LIVE, None, "none"),
    "live-kill": (LIVE, "SIGKILL", "live-base"),
    "live-replace": ([*LIVE, "launch.max_restarts=1"], "SIGKILL", "live-base"),
    "live-hang": (LIVE, "SIGSTOP", "live-base"),
}
VICTIM = 2


def steps_logged(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's records, in file order (a line still being written is skipped)."""
    path, steps = run_dir / "metrics.jsonl", []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                steps.append(json.loads(line)["step"])
    return steps


def rank0_records(run_dir: Path) -> list[tuple[int, float]]:
    """(step, time) of the records in rank 0's log, every attempt's, in order."""
    log = run_dir / "logs" / "rank0.log"
    log = log if log.exists() else run_dir / "logs" / "member0.log"
    found = re.findall(r"^(\S+ \S+) \|.*metrics:log:\d+ - step=(\d+)", log.read_text(), re.M) if log.exists() else []
    return [(int(step), datetime.strptime(at, "%Y-%m-%d %H:%M:%S.%f").timestamp()) for at, step in found]


def stalls(records: list[tuple[int, float]], change_steps: list[int]) -> list[float]:
    """Seconds lost beyond the run's median seconds per step: across a restart (the records' steps drop), else
    around each membership change (see the module's docstring)."""
    pairs = [(a, b) for a, b in zip(records, records[1:]) if b[0] > a[0]]
    if not pairs:
        return []
    per_step = statistics.median((b[1] - a[1]) / (b[0] - a[0]) for a, b in pairs)
    excess = lambda a, b: b[1] - a[1] - per_step * (b[0] - a[0])  # noqa: E731
    drops = [i for i in range(1, len(records)) if records[i][0] <= records[i - 1][0]]
    if drops:
        before = records[drops[0] - 1]
        return [excess(before, next(r for r in records[drops[0]:] if r[0] > before[0]))]
    return [sum(max(0.0, excess(a, b)) for a, b in pairs if s - 10 < b[0] <= s + 10) for s in change_steps]


def live_pid(run_dir: Path, member: int) -> int | None:
    """The pid of a live member, from the supervisor's workers.json (retried: it may be half-written)."""
    for _ in range(20):
        with contextlib.suppress(OSError, ValueError, KeyError):
            return json.loads((run_dir / "workers.json").read_text())[str(member)]
        time.sleep(0.01)
    return None


def torchrun_worker(run_dir: Path, rank: int) -> int | None:
    """The pid of this run's torchrun worker of ``rank`` (from /proc: its command line names the run's config)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"decent_train.worker" in cmdline and str(run_dir).encode() in b" ".join(cmdline) \
                and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def run_one(name: str, run_dir: Path, at: int, timeout: float, detect_s: float) -> dict[str, Any]:
    """One job of ``name`` into ``run_dir``; the signal, if any, sent once its records reach step ``at``."""
    overrides, sig, _ = VARIANTS[name]
    live = "fault_tolerance=live" in overrides
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    detect = [f"fault_tolerance.detect_s={detect_s:g}"] if live else []
    command = [str(COMMAND), *JOB, *overrides, *detect, f"hydra.run.dir={run_dir}"]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    run: dict[str, Any] = {"variant": name, "command": command, "run_dir": str(run_dir), "output": str(log_path),
                           "load_before": os.getloadavg()[0]}
    start, started_at, result = time.monotonic(), time.time(), run_dir / "result.json"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None and time.monotonic() - start < timeout:
                if "to_result_s" not in run and result.exists():  # rank 0's; the launcher rewrites it at the end
                    run["to_result_s"] = result.stat().st_mtime - started_at
                if sig and "signal_at_step" not in run and (steps := steps_logged(run_dir)) and steps[-1] >= at:
                    pid = live_pid(run_dir, VICTIM) if live else torchrun_worker(run_dir, VICTIM)
                    if pid:
                        os.kill(pid, getattr(signal, sig))
                        run |= {"signal": sig, "signal_at_step": steps[-1], "signal_at_s": time.monotonic() - start}
                time.sleep(0.05)
            if proc.poll() is None:
                run["failed"] = f"stopped after {timeout:g} s"
        finally:
            with contextlib.suppress(ProcessLookupError):  # what is left of the job (a stopped worker, if it failed)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run |= {"process_wall_s": time.monotonic() - start, "exit": proc.returncode}
    if proc.returncode != 0:  # the table says why; a run whose rank 0 wrote its result is still measured
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        run["launcher_failed"] = lines[-1] if lines else f"exit {proc.returncode}"
    try:
        return measure(run)
    except Exception as error:  # noqa: BLE001  (files this script did not expect: the other runs still go on)
        return run | {"failed": f"not measured: {error!r}"}


def measure(run: dict[str, Any]) -> dict[str, Any]:
    """What the run's files say: its result, steps, membership changes and stalls."""
    run_dir, output = Path(run["run_dir"]), Path(run["output"])
    if "to_result_s" not in run or not (run_dir / "result.json").exists():
        run.setdefault("failed", run.get("launcher_failed", f"exit {run['exit']}"))
        return run
    measured = json.loads((run_dir / "result.json").read_text())
    records, metrics = rank0_records(run_dir), steps_logged(run_dir)
    steps = [step for step, _ in records]
    drops = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    changes = measured.get("membership_changes")
    if changes is None and "fault_tolerance=live" in run["command"]:  # the launcher adds them only if it succeeds
        changes = changes_printed(output.read_text())
    run |= {
        "wall_s": measured.get("wall_time_s"),  # None: the launcher failed
        "accuracy": measured["eval/accuracy"],
        "resumed_from_step": measured["resumed_from_step"],
        "steps_increase": not drops and all(a < b for a, b in zip(metrics, metrics[1:])),
        "steps_repeated": steps[drops[0] - 1] - measured["resumed_from_step"] if drops else 0,
        "membership_changes": changes,
        "stall_s": stalls(records, [c["step"] for c in changes or [] if c["lost"] and "step" in c]),
        "join_stall_s": stalls(records, joins) if (joins := [c["step"] for c in changes or [] if c["joined"]
                                                             and "step" in c]) else [],
        "changes_after_training": sum(1 for c in changes or [] if "step" not in c),  # no member reached a step
    }
    return run


def changes_printed(output: str) -> list[dict[str, Any]]:
    """The membership changes as the job printed them (rank 0's console): a loss or a join, then its first step."""
    changes: list[dict[str, Any]] = []
    for line in output.splitlines():
        if m := re.search(r"step (\d+): .*lost \(.*continuing on", line):
            changes.append({"step": int(m[1]), "lost": [line.split(": ", 2)[-1]], "joined": [], "from": "output"})
        elif m := re.search(r"step (\d+): .*joined, healed from member \d+ \(rank \d+\) \(([\d.]+) MB, ([\d.]+) s\)",
                            line):
            changes.append({"step": int(m[1]), "lost": [], "joined": [line.split(": ", 2)[-1]],
                            "heal_mb": float(m[2]), "heal_s": float(m[3]), "from": "output"})
        elif (m := re.search(r"first step after the change, ([\d.]+) s after", line)) and changes:
            changes[-1]["recovery_s"] = float(m[1])
    return changes


def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per variant: medians and ranges over its rounds; time lost: paired by round against its baseline."""
    ok = {(r["variant"], r["round"]): r for r in runs if "failed" not in r}
    summary = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name and "failed" not in r]
        base = VARIANTS[name][2]
        pairs = [(r, ok[(base, r["round"])]) for r in mine if (base, r["round"]) in ok]
        changes = [c for r in mine for c in r["membership_changes"] or []]
        summary[name] = {
            "overrides": VARIANTS[name][0], "signal": VARIANTS[name][1], "baseline": base,
            "runs": len(mine), "failed": [r["failed"] for r in runs if r["variant"] == name and "failed" in r],
            "launcher_failed": [r["launcher_failed"] for r in runs if r["variant"] == name and "launcher_failed" in r],
            "changes_after_training": sum(r["changes_after_training"] for r in mine),
            "to_result_s": spread([r["to_result_s"] for r in mine]),
            "wall_s": spread([r["wall_s"] for r in mine if r["wall_s"] is not None]),
            "process_wall_s": spread([r["process_wall_s"] for r in mine]),
            "lost_s": spread([r["to_result_s"] - b["to_result_s"] for r, b in pairs]),
            "lost_wall_s": spread([r["wall_s"] - b["wall_s"] for r, b in pairs if r["wall_s"] and b["wall_s"]]),
            "stall_s": spread([x for r in mine for x in r["stall_s"]]),
            "join_stall_s": spread([x for r in mine for x in r["join_stall_s"]]),
            "accuracy": spread([r["accuracy"] for r in mine]),
            "signal_at_step": sorted(r["signal_at_step"] for r in mine if "signal_at_step" in r),
            "steps_increase": all(r["steps_increase"] for r in mine),
            "steps_repeated": sorted(r["steps_repeated"] for r in mine),
            "recovery_s": spread([c["recovery_s"] for c in changes if "recovery_s" in c and c["lost"]]),
            "join_recovery_s": spread([c["recovery_s"] for c in changes if "recovery_s" in c and c["joined"]]),
            "join_step": sorted(c["step"] for c in changes if c["joined"]),
            "heal_mb": spread([c["heal_mb"] for c in changes if "heal_mb" in c]),
            "heal_s": spread([c["heal_s"] for c in changes if "heal_s" in c]),
        }
    return summary


def _s(x: dict[str, float] | None, fmt: str = "{:.1f}") -> str:
    if x is None:
        return "-"
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])} to {fmt.format(x['max'])})"


def table(summary: dict[str, Any]) -> str:
    """Medians (min to max) over the rounds."""
    lines = ["| variant | to result.json s | lost s | launcher wall s | lost s (wall) | stall s (loss; join) | "
             "eval/accuracy | signal at step | steps repeated | recovery s (loss; join) | heal MB, s (join step) | "
             "launcher |", "|" + "---|" * 12]
    for name, r in summary.items():
        sent = f"{r['signal']} {', '.join(map(str, r['signal_at_step']))}" if r["signal"] else "-"
        repeated = ", ".join(map(str, r["steps_repeated"])) + ("" if r["steps_increase"] else " (records repeat)")
        stall = "; ".join(_s(r[k], "{:.2f}") for k in ("stall_s", "join_stall_s") if r[k])
        recovery = "; ".join(_s(r[k], "{:.2f}") for k in ("recovery_s", "join_recovery_s") if r[k])
        heal = (f"{r['heal_mb']['median']:.2f}, {_s(r['heal_s'], '{:.2f}')} ({', '.join(map(str, r['join_step']))})"
                if r["heal_mb"] else "-")
        failures = r["failed"] + r["launcher_failed"]
        short = failures[0].split("error: ")[-1].split(":")[0] if failures else ""  # the JSON has the whole line
        launcher = f"{len(failures)} of {r['runs'] + len(r['failed'])} failed: {short}" if failures else "ok"
        if r["changes_after_training"]:
            launcher += f"; {r['changes_after_training']} change(s) of members after training"
        lines.append(f"| {name} | {_s(r['to_result_s'])} | {_s(r['lost_s'], '{:+.1f}')} | {_s(r['wall_s'])} | "
                     f"{_s(r['lost_wall_s'], '{:+.1f}')} | {stall or '-'} | {_s(r['accuracy'], '{:.4f}')} | {sent} | "
                     f"{repeated} | {recovery or '-'} | {heal} | {launcher} |")
    return "\n".join(lines)


def alternated_rounds(names: list[str], repeats: int, run_one: Callable[[str, int], dict[str, Any]],
                      describe: Callable[[dict[str, Any]], str]) -> tuple[list[dict[str, Any]], list[str]]:
    """``run_one(variant, round)`` for every variant in each of ``repeats`` rounds, each round starting one variant
    later, so that the machine's drift hits all alike; the runs, and ``uptime`` before and after."""
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(f"uptime: {uptime[0]}", flush=True)
    runs = []
    for k in range(repeats):
        for name in names[k % len(names):] + names[:k % len(names)]:
            run = run_one(name, k) | {"round": k}
            runs.append(run)
            print(f"round {k} {name}: {describe(run)} (process {run['process_wall_s']:.1f} s, load average "
                  f"{os.getloadavg()[0]:.1f})", flush=True)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(f"uptime: {uptime[1]}", flush=True)
    return runs, uptime


def describe(run: dict[str, Any]) -> str:
    if "failed" in run:
        return f"FAILED: {run['failed']}"
    sent = f", {run['signal']} at step {run['signal_at_step']}" if "signal" in run else ""
    launcher = f"; the launcher failed: {run['launcher_failed']}" if "launcher_failed" in run else ""
    return f"result.json after {run['to_result_s']:.1f} s, eval/accuracy {run['accuracy']:.4f}{sent}{launcher}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs every variant once")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--at", type=int, default=250, help="the signal is sent once metrics.jsonl reaches this step")
    p.add_argument("--detect-s", type=float, default=2.0, help="the live runs' fault_tolerance.detect_s")
    p.add_argument("--out", type=Path, default=Path("bench/fault_tolerance.json"),
                   help="the JSON results; the runs go into the folder of the same name without .json")
    p.add_argument("--timeout", type=float, default=180, help="seconds a run may take before it is stopped")
    p.add_argument("--from", dest="from_json", type=Path, default=None,
                   help="no runs: measure the runs of an earlier --out again from their folders, print the table and "
                   "rewrite that JSON")
    args = p.parse_args()
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        runs = [measure(run) for run in saved["runs"]]
        saved["summary"] = summarize(runs, list(saved["summary"]))
        print(table(saved["summary"]))
        args.from_json.write_text(json.dumps(saved | {"runs": runs}, indent=2) + "\n")
        return
    names = [n for n in args.variants.split(",") if n]
    if unknown := [n for n in names if n not in VARIANTS]:
        sys.exit(f"bench_fault_tolerance.py: no variant {', '.join(unknown)}; valid: {', '.join(VARIANTS)}")
    runs_dir = args.out.with_suffix("").resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs, uptime = alternated_rounds(
        names, args.repeats, lambda name, k: run_one(name, runs_dir / f"{name}-r{k}", args.at, args.timeout,
                                                     args.detect_s), describe)
    summary = summarize(runs, names)
    print(table(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"argv": sys.argv, "job": [COMMAND.name, *JOB], "detect_s": args.detect_s,
                                    "uptime": uptime, "cpus": os.cpu_count(), "summary": summary, "runs": runs},
                                   indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
