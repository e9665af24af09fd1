"""scripts/gpu_check.sh on a machine without a GPU: its skip mode, and its pass/fail decisions fed made-up results
(the benchmark's JSON, pytest's junit XML, the default job's run folder) — checks of the decision code, not of a GPU.

The oracle is the rule the script states: it fails on any failed step or test, on engine / plain above
``OVERHEAD_BOUND`` (1.10) or a missing benchmark result, and on a default job that did not reach ``CLI_ACCURACY`` with
finite losses; a missed target (1.03, 1.05) is reported, not failed. Each case changes one input of an otherwise
passing run, whose verdict is checked to be "passed" too (so the check can pass as well as fail).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import import_script
from tests.on_gpu import SKIP_REASON

ROOT = Path(__file__).resolve().parents[1]
gpu_check = import_script("gpu_check")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_world_size_1_on_cuda_matches_replay[fp64-sgd]" time="1.5"/>
<testcase classname="tests.test_gpu_fronts" name="test_fronts_at_world_size_1_match_the_replay[diloco-exact]"
 time="0.7">{failure}</testcase>
<testcase classname="tests.test_gpu" name="test_ranks_share_one_gpu_with_nccl_hostid" time="9.0">
<skipped type="pytest.xfail" message="NCCL refused: Duplicate GPU detected"/></testcase>
</testsuite></testsuites>
"""
FAILURE = '<failure message="AssertionError: diloco on cuda is 0.3 from the replay">trace</failure>'


def _bench(*pairs: tuple[str, float]) -> dict[str, Any]:
    """bench_overhead.py's JSON with these (model, engine / plain) at a plain step of 100 ms."""
    return {"results": {model: {"plain_ms": 100.0, "engine_ms": 100.0 * ratio, "engine_over_plain": ratio}
                        for model, ratio in pairs}}


def _fake_run(scratch: Path, out: Path, ratios: dict[tuple[str, str], float], failed_test: bool = False,
              accuracy: float = 0.98, loss: float = 0.1) -> list[Any]:
    """A finished run's files: the benchmark's JSON per run, junit.xml, the default job's folder; its steps (all
    ok)."""
    for run in gpu_check.OVERHEAD_RUNS:
        pairs = [(model, ratio) for (model, r), ratio in ratios.items() if r == run]
        (scratch / f"overhead_{run}.json").write_text(json.dumps(_bench(*pairs)))
    (scratch / "junit.xml").write_text(JUNIT.format(failure=FAILURE if failed_test else ""))
    run = {"model_mib": 512.0, "front_device_mib_max": 128.0, "front_device_mib_max_in_outer_step": 160.0,
           "front_host_mib_max": 1024.0, "peak_over_model_mib": 1100.0, "inner_step_ms": 10.5,
           "step_with_outer_ms": 12.25, "steady_step_ms": 6.75}
    (scratch / "offload.json").write_text(json.dumps({"summary": {"on device": run, "offload": run}}))
    job = scratch / "cli_job"
    job.mkdir()
    (job / "result.json").write_text(json.dumps({"eval/accuracy": accuracy, "steps": 1800, "world_size": 1}))
    (job / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "train/loss": v})
                                                 for s, v in [(10, 2.3), (20, loss)]) + "\n")
    steps = gpu_check.plan(out, scratch)
    for step in steps:
        step.status = "ok"
    return steps


def _verdict(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    out.mkdir()
    ratios = {key: 1.0 for key in gpu_check.OVERHEAD_TARGETS} | changes.pop("ratios", {})
    steps = _fake_run(scratch, out, ratios, **changes)
    ok, text = gpu_check.write_summary(out, steps, {"gpus": ["fake"]}, "fake", 0.0, scratch)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is ok and ("passed" if ok else "FAILED") in text.splitlines()[0]
    return summary


def test_a_run_where_everything_passed_passes(tmp_path: Path) -> None:
    summary = _verdict(tmp_path, ratios={("resnet50", "b64"): 1.04})  # within its target, 1.05
    assert summary["passed"] and summary["failures"] == []
    assert [o["target_met"] for o in summary["overhead"]] == [True, True, True]
    assert summary["tests"]["passed"] == 2 and summary["tests"]["skipped"] == 1  # the xfail counts as skipped
    assert summary["offload"]["offload"]["front_device_mib_max_in_outer_step"] == 160.0
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "| offload | 512 MiB | 128 MiB | 160 MiB | 1024 MiB | 1100 MiB | 10.50 | 12.25 | 6.75 |" in text


@pytest.mark.parametrize("model, run, ratio, passes", [
    ("resnet50", "b256", 1.20, False),  # above the bound: fails
    ("gpt2", "b256", 1.101, False),
    ("resnet50", "b64", 1.08, True),  # above the target 1.05, under the bound: reported, passes
    ("gpt2", "b256", 1.05, True),
], ids=["resnet50-b256-1.20", "gpt2-1.101", "resnet50-b64-1.08", "gpt2-1.05"])
def test_overhead_fails_above_the_bound_and_reports_the_target(tmp_path: Path, model: str, run: str, ratio: float,
                                                                passes: bool) -> None:
    summary = _verdict(tmp_path, ratios={(model, run): ratio})
    row = next(o for o in summary["overhead"] if (o["model"], o["run"]) == (model, run))
    assert row["engine_over_plain"] == pytest.approx(ratio) and not row["target_met"]
    assert summary["passed"] is passes
    if not passes:
        assert summary["failures"] == [f"overhead: {model} batch {row['batch']}: engine {ratio:.3f}x the plain loop, "
                                       "above the bound 1.10x"]


def test_a_missing_benchmark_result_fails(tmp_path: Path) -> None:
    summary = _verdict(tmp_path)
    (tmp_path / "again").mkdir()
    rows, failures = gpu_check.judge_overhead({"b256": _bench(("resnet50", 1.0)), "b64": {}})
    assert summary["passed"] and len(rows) == 1
    assert [f.split(":")[1].strip() for f in failures] == ["no result for gpt2 (batch 8)",
                                                           "no result for resnet50 (batch 64)"]


def test_a_failed_test_fails_the_check(tmp_path: Path) -> None:
    summary = _verdict(tmp_path, failed_test=True)
    assert not summary["passed"]
    assert summary["failures"] == ["test test_gpu_fronts::test_fronts_at_world_size_1_match_the_replay[diloco-exact]: "
                                   "AssertionError: diloco on cuda is 0.3 from the replay"]


@pytest.mark.parametrize("accuracy, loss, failure", [(0.9, 0.1, "accuracy 0.9 below"),
                                                      (0.98, float("nan"), "losses are not all finite")])
def test_the_default_job_must_reach_its_accuracy_with_finite_losses(tmp_path: Path, accuracy: float, loss: float,
                                                                    failure: str) -> None:
    summary = _verdict(tmp_path, accuracy=accuracy, loss=loss)
    assert not summary["passed"] and len(summary["failures"]) == 1 and failure in summary["failures"][0]


def test_a_step_that_did_not_finish_fails_and_pytest_v_lines_stand_in_for_junit(tmp_path: Path) -> None:
    """The tests' step killed at its limit writes no junit XML: the outcomes come from ``pytest -v``'s lines."""
    output = ("tests/test_gpu.py::test_bf16_engine_trains_like_plain_loop PASSED [ 10%]\n"
              "tests/test_gpu_fronts.py::test_peak_memory_of_the_fronts_vs_plain_loop \n"  # -s: what it prints between
              "GPU_CHECK {\"test\": \"memory/front/diloco\"}\nFAILED [ 20%]\n"
              "tests/test_gpu.py::test_processes_on_one_gpu_match_replay[ring2] SKIPPED (NCCL refused) [ 30%]\n"
              "tests/test_gpu.py::test_ranks_share_one_gpu_with_nccl_hostid \n")  # killed while it ran: no outcome
    tests = gpu_check.parse_verbose(output)
    assert (tests["passed"], tests["failed"], tests["skipped"]) == (1, 1, 1)
    steps = gpu_check.plan(tmp_path, tmp_path)
    for step in steps:
        step.status = "ok"
    steps[-1].status = "TIMED OUT after 330 s"
    failures = gpu_check.judge(steps, tests, [], [])
    assert failures == ["step [tests]: TIMED OUT after 330 s",
                        "test tests/test_gpu_fronts.py::test_peak_memory_of_the_fronts_vs_plain_loop: "]
    assert gpu_check.judge(steps[:-1], {"tests": []}, [], []) == ["tests: no test results (junit.xml nor pytest -v "
                                                                  "lines)"]


@pytest.mark.slow
def test_skip_mode_says_what_it_would_run(tmp_path: Path) -> None:
    """Without a CUDA device: exit 0, "no CUDA GPU: skip mode", every step of the plan named, the GPU tests shown
    skipping with their reason, summary.md and the console's copy in OUT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA GPU: skip mode" in proc.stdout
    planned = [f"[{s.key}]" for s in gpu_check.plan(tmp_path, tmp_path)] + ["[summary]"]
    assert planned == ["[env]", "[overhead-b256]", "[overhead-b64]", "[offload]", "[cli-job]", "[tests]",
                       "[summary]"]
    for step in planned:
        assert step in proc.stdout, f"the plan does not name {step}"
    assert "bench_overhead.py" in proc.stdout and "-m gpu" in proc.stdout and "launch=gpu" in proc.stdout
    assert SKIP_REASON in proc.stdout, "pytest should show the GPU tests skipping with their reason"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "skip mode" in summary and all(step in summary for step in planned)
    assert "no CUDA GPU: skip mode" in (tmp_path / "out" / "gpu_check.log").read_text()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.log", "summary.md"]
