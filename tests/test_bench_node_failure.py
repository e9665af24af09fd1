"""scripts/bench_node_failure.py without a launch: the time lost paired by round from made-up runs, a restart's stall
from a made-up rank 0 log when no record repeats, and the one-line refusals (the launches themselves are the
benchmark's: scripts/BENCHMARKS.md)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import import_script
from tests.netns import nodes_available

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_node_failure.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script("bench_node_failure")


def made_up(variant: str, round_: int, to_result_s: float, **more: Any) -> dict[str, Any]:
    """A run as run_one leaves it once measured (the fields summarize reads)."""
    return {"variant": variant, "round": round_, "to_result_s": to_result_s, "stall_s": [], "accuracy": 0.98,
            "steps_increase": True, "steps_repeated": 0, "resumed_from_step": 0, "membership_changes": None,
            **more}


def rows_of(table: str) -> dict[str, str]:
    """The table's rows by variant."""
    return {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}


def test_time_lost_is_each_run_minus_its_baseline_of_the_same_round(bench: Any) -> None:
    # round 1 is a slow round for everyone: paired by round, its noise cancels; the failed baseline of round 2 pairs
    # with nothing, and the failed live-kill is counted, not measured; round 3's baseline pairs with no variant
    base = {0: 60.0, 1: 75.0}
    restart = {0: 83.0, 1: 101.0, 2: 90.0}
    live_base = {0: 40.0, 1: 52.0, 2: 41.0}
    live_kill = {0: 42.5, 1: 55.0}
    runs = [*(made_up("restart-base", k, s) for k, s in base.items()),
            made_up("restart-base", 2, 0.0) | {"failed": "stopped after 420 s"},
            made_up("restart-base", 3, 70.0) | {"launcher_failed": "node2.txt: decent-train: error: ..."},
            *(made_up("restart", k, s, stall_s=[20.0 + k], steps_repeated=25, resumed_from_step=150)
              for k, s in restart.items()),
            *(made_up("live-base", k, s) for k, s in live_base.items()),
            *(made_up("live-kill", k, s, stall_s=[1.5 + k], membership_changes=[
                {"step": 180, "lost": [{"member": 2}, {"member": 3}], "joined": [], "members": 4,
                 "recovery_s": 0.1}]) for k, s in live_kill.items()),
            made_up("live-kill", 2, 0.0) | {"failed": "no node was killed"}]
    summary = bench.summarize(runs, list(bench.VARIANTS))

    def paired(variant: dict[int, float], baseline: dict[int, float]) -> dict[str, float]:
        lost = [variant[k] - baseline[k] for k in variant if k in baseline]
        return {"median": statistics.median(lost), "min": min(lost), "max": max(lost)}

    assert summary["restart"]["lost_s"] == paired(restart, base)  # 23, 26: round 2 has no baseline
    assert summary["live-kill"]["lost_s"] == paired(live_kill, live_base)
    assert summary["live-base"]["lost_s"] == paired(live_base, base)  # the live path's overhead, uninterrupted
    assert summary["restart-base"]["lost_s"] is None and summary["restart-base"]["runs"] == 3
    # a launcher that failed after rank 0's result.json: measured, and said
    assert rows_of(bench.table(summary))["restart-base"].endswith(
        "| 3 measured (1 with a launcher failing after: node2.txt: decent-train: error: ...); 1 failed: stopped "
        "after 420 s |")
    assert summary["restart-base"]["failed"] == ["stopped after 420 s"]
    assert summary["live-kill"]["runs"] == 2 and summary["live-kill"]["members_after"] == [4]
    assert summary["restart"]["stall_s"] == {"median": 21.0, "min": 20.0, "max": 22.0}

    rows = rows_of(bench.table(summary))
    assert "+24.5 (+23.0 to +26.0) (vs restart-base)" in rows["restart"]
    assert rows["live-kill"].endswith("| 2 measured; 1 failed: no node was killed |")
    assert "25, 25, 25 (150, 150, 150)" in rows["restart"]


def rank0_log(run_dir: Path, times: dict[int, float]) -> None:
    """rank 0's log with a record line per step at ``times`` (seconds after a fixed moment), as loguru writes it."""
    start = datetime(2026, 11, 26, 12, 0, 0)
    lines = [f"{(start + timedelta(seconds=t)).strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]} | DEBUG    | "
             f"decent_train.components.metrics:log:133 - step={step} train/loss=0.1" for step, t in times.items()]
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("\n".join(lines) + "\n")


def test_a_restart_that_repeats_no_record_stalls_for_its_gap_beyond_a_normal_interval(bench: Any,
                                                                                      tmp_path: Path) -> None:
    # records every 10 steps, 0.2 s apart; the node killed right after the checkpoint at 150, the restart resuming
    # there: the record of 160 comes 23 s after 150's, and no record repeats
    run_dir = tmp_path / "run"
    times = {step: step / 50 for step in range(10, 151, 10)}
    times |= {step: times[150] + 23.0 + (step - 160) / 50 for step in range(160, 301, 10)}
    rank0_log(run_dir, times)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in times))
    (run_dir / "result.json").write_text(json.dumps({"eval/accuracy": 0.99, "resumed_from_step": 150,
                                                     "wall_time_s": 60.0}))
    output = tmp_path / "node0.txt"
    output.write_text("")
    run = bench.measure({"variant": "restart", "run_dir": str(run_dir), "output": str(output), "exit": 0,
                         "to_result_s": 61.0, "command": ["decent-train", "launch.nnodes=2:3"]})
    assert run["steps_repeated"] == 0 and run["steps_increase"]
    assert run["stall_s"] == [pytest.approx(23.0 - 0.2)]  # the gap, less the 0.2 s 10 steps take


def test_a_delay_is_made_where_netem_or_the_delay_line_runs_else_one_line_naming_the_flag(bench: Any) -> None:
    refused = bench.latency(5.0)
    if nodes_available() is not None:
        assert refused.startswith("bench_node_failure.py: cannot make the nodes here")
    elif nodes_available(delay=True) is None:  # netem, or tests/netns.py's userspace delay line without it
        assert refused is None
    else:
        assert "--delay-ms 5" in refused and "valid here: --delay-ms 0" in refused and "\n" not in refused
    assert bench.latency(0.0) == (None if nodes_available() is None else refused)


def test_the_delay_lines_cpu_is_a_share_of_each_runs_wall_time(bench: Any) -> None:
    runs = [made_up("live-base", 0, 40.0, delay_line_cpu_s=2.0, process_wall_s=50.0),
            made_up("live-base", 1, 40.0, delay_line_cpu_s=3.0, process_wall_s=30.0),
            made_up("restart-base", 0, 60.0)]  # no delay line: no share
    summary = bench.summarize(runs, ["restart-base", "live-base"])
    assert summary["live-base"]["delay_line_cpu_pct"] == {"median": 7.0, "min": 4.0, "max": 10.0}
    assert summary["restart-base"]["delay_line_cpu_pct"] is None
    assert bench.delay_line_cost(summary).endswith(": live-base 7.0 (4.0 to 10.0)")
    assert bench.delay_line_cost(bench.summarize(runs[2:], ["restart-base"])) == ""


@pytest.mark.parametrize(("flags", "named"), [(["--at", "300"], "--at 300"), (["--variants", "restart,bogus"],
                                                                               "no variant bogus")])
def test_bad_flags_are_one_line_before_any_node_is_made(flags: list[str], named: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
