"""Every wait of live membership has a bound (issue 38, point 3): faults caused for real in launched runs.

- A founder stopped (SIGSTOP) before its hello: the launch stops with one line naming it, instead of waiting forever.
- A member paused for 4 s (SIGSTOP, then SIGCONT), a transient fault under every bound: no change, nothing repeated.
- A member alive but stuck (its training thread hangs before a record step's barrier, its heartbeat beats on): the
  others report it after ``comm_timeout_s``, the coordinator has it killed, and the run goes on without it.
- A member SIGKILLed inside a record step's collective: the first gather, the consensus distance's all-reduce or the
  evaluation's (it stops itself there, through the test hook ``live.PAUSE_ENV``: the hook only delays it; the kill
  is real): every survivor completes its next record
  step in less than the record step's own bound (RECORD_FLOOR_S, 10 s), let alone ``comm_timeout_s`` (120 s here):
  the plan without the dead member ends the survivors' collectives (a survivor with no connection to it would wait in
  that all-reduce for the peers that failed out of it).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from decent_train.training.live import PAUSE_ENV, RECORD_FLOOR_S
from decent_train.training.live_changes import HANG_AT_ENV

from .test_elastic import alive, stopped
from .test_live_launcher import Ready, Signal, Watch, check_trained_to_the_end, launch

pytestmark = pytest.mark.alone  # it times its faults or starves the machine: no test shares it (tests/conftest.py)

PAUSE_AT = 200  # a record step (logger.log_every=10) that also measures consensus (10) and evaluates (100)
COMM_TIMEOUT_S = 120


def _started(member: int) -> Ready:
    return lambda watch: member in watch.workers()


@pytest.mark.slow
def test_a_founder_hung_before_hello_stops_the_launch_with_one_line(tmp_path: Path) -> None:
    run = launch(tmp_path, signals=[Signal(_started(1), signal.SIGSTOP, [1])])
    assert run.returncode != 0, f"{run}"
    naming = [line for line in run.console.splitlines() if "worker 1 hung before training started" in line]
    assert len(naming) == 1, f"{run}"
    assert "no hello within" in naming[0], f"{run}"
    assert "Traceback" not in run.console, f"{run}"
    assert 1 not in run.outlived and not alive(run.sent[0][1][1]), f"{run}"
    assert not (run.run_dir / "metrics.jsonl").exists() or run.steps() == [], f"{run}"


@pytest.mark.slow
@pytest.mark.parametrize("collective", ["", "consensus distance", "evaluation"],
                         ids=["the-first-gather", "the-consensus-all-reduce", "the-evaluation-all-reduce"])
def test_a_member_killed_inside_a_record_collective_costs_seconds_not_comm_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collective: str
) -> None:
    # member 2 stops itself past step 200's barrier (the others wait in the step's first gather), or just before the
    # collective so described (engine/comm.py's stop_before): the others wait inside it
    monkeypatch.setenv(PAUSE_ENV, f"2:{PAUSE_AT}:{collective}")
    stopped_since: list[float] = []

    def inside_the_collective(watch: Watch) -> bool:
        """Member 2 stopped for a second: the others are in the step's first collective, waiting for it."""
        pid = watch.workers().get(2)
        if pid is None or not stopped(pid):
            return False
        stopped_since.append(time.monotonic())
        return stopped_since[-1] - stopped_since[0] > 1.0

    run = launch(tmp_path, f"comm_timeout_s={COMM_TIMEOUT_S}",
                 signals=[Signal(inside_the_collective, signal.SIGKILL, [2])])
    check_trained_to_the_end(run)
    assert run.members() == [4, 3], f"{run}"
    (change,) = run.result["membership_changes"]
    assert change["lost"] == [{"rank": 2, "member": 2, "why": "killed by SIGKILL"}], f"{run}"
    # Rank 0's records around the kill: step 200's is skipped (a survivor's collective failed), the next one comes
    # once the plan without member 2 ended the survivors' collectives (its node's agent sees the death in POLL_S),
    # before the record step's own bound (RECORD_K x the median step, at least RECORD_FLOOR_S) would end them.
    before = [r for r in run.records if r["step"] < PAUSE_AT]
    after = [r for r in run.records if r["step"] > PAUSE_AT]
    gap = after[0]["time/elapsed_s"] - before[-1]["time/elapsed_s"]
    print(f"{collective or 'the first gather'}: records {before[-1]['step']} -> {after[0]['step']}: {gap:.2f} s")
    assert gap < RECORD_FLOOR_S, f"records {before[-1]['step']} -> {after[0]['step']}: {gap:.1f} s\n{run}"
    assert change["step"] == after[0]["step"] or change["step"] > PAUSE_AT, f"{run}"
    if collective:  # a survivor was inside that collective when member 2 died
        logs = "".join(log.read_text() for log in (run.run_dir / "logs").glob("*.log")) + run.console
        assert f"{collective}'s all-reduce failed" in logs, f"{run}"


@pytest.mark.slow
def test_a_member_paused_for_seconds_is_absorbed_without_a_change(tmp_path: Path) -> None:
    """A transient fault, shorter than every bound (a member SIGSTOPped for 4 s, below ``fault_tolerance.detect_s``,
    10 s, and the record step's floor, 10 s, then SIGCONTinued): the run goes on with the same members, no step
    repeated, as if nothing happened. The bounds above must not turn a hiccup into a membership change."""
    paused_at: list[float] = []

    def pause_now(watch: Watch) -> bool:
        if watch.last_step() < 300:
            return False
        paused_at.append(time.monotonic())
        return True

    def four_seconds_later(watch: Watch) -> bool:
        pid = watch.workers()[2]
        return time.monotonic() - paused_at[0] > 4.0 and stopped(pid)

    run = launch(tmp_path, signals=[Signal(pause_now, signal.SIGSTOP, [2]),
                                    Signal(four_seconds_later, signal.SIGCONT, [2])])
    check_trained_to_the_end(run)
    assert run.members() == [4], f"{run}"
    assert run.result["membership_changes"] == [], f"{run}"
    during = [r for r in run.records if r["step"] > run.sent[0][0]]
    assert during, f"no record after the pause\n{run}"


@pytest.mark.slow
def test_a_member_stuck_but_beating_is_reported_killed_and_dropped(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Member 2's training thread hangs at record step 200, before its barrier (``HANG_AT_ENV``); its heartbeat
    thread beats on, so silence never declares it dead. The others, at the barrier, report it after comm_timeout_s
    (20 s); the coordinator has its agent kill it and plans without it: 4 -> 3, one change, and the survivors'
    longest gap between records is about comm_timeout_s, not the run's timeout."""
    comm_timeout_s = 20
    monkeypatch.setenv(HANG_AT_ENV, f"2:{PAUSE_AT}")
    run = launch(tmp_path, f"comm_timeout_s={comm_timeout_s}", signals=[])
    check_trained_to_the_end(run)
    assert run.members() == [4, 3], f"{run}"
    (change,) = run.result["membership_changes"]
    assert [(x["member"], x["rank"]) for x in change["lost"]] == [(2, 2)], f"{run}"
    assert change["lost"][0]["why"].startswith("stuck: not at ") and "comm_timeout_s" in change["lost"][0]["why"], \
        f"{run}"
    assert change["joined"] == [] and change["step"] >= PAUSE_AT, f"{run}"
    written = [r["time/elapsed_s"] for r in run.records]
    gap = max(b - a for a, b in zip(written, written[1:]))
    print(f"longest gap between records: {gap:.1f} s (comm_timeout_s={comm_timeout_s})")
    assert comm_timeout_s <= gap < comm_timeout_s + 10, f"{gap}\n{run}"
