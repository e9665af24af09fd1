"""scripts/benchmark.py end to end on a tiny model: every implementation is measured in one launch, and the ratios
in its results are the ones its own numbers give (speed itself is never asserted: the machine is shared)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmark.py"


@pytest.mark.slow
def test_benchmark_measures_every_implementation_and_draws_the_chart(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers=2", "--width=32", "--depth=1", "--batch=8", "--steps=2",
         "--warmup=1", "--repeats=1", "--topologies=ring,alternating-exp-ring,allreduce", "--optim=accum_adamw",
         "--compression=int8", f"--out={out}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / "results.json").read_text())["runs"]["2"]
    assert run["setup"] == {"optim": "accum_adamw", "bucket_mb": 25, "local_world_size": 1, "message_mb": 0,
                            "compression": "none"}
    results = run["results"]
    assert set(results) == {
        "local", "ddp", "decent_train/ring", "decent_train/alternating-exp-ring", "decent_train/allreduce",
        "decent_dp/ring", "decent_train/ring/int8", "decent_train/alternating-exp-ring/int8",
    }  # decent_train/allreduce: the engine's all-reduce mode (never compressed)
    # Bytes on the loopback per step: the int8 ring sends about a quarter of the float32 ring (plus gloo's headers).
    ratio = results["decent_train/ring/int8"]["wire_bytes_per_step"] / results["decent_train/ring"]["wire_bytes_per_step"]
    assert 0.1 < ratio < 0.6
    # decent-dp 0.2.3 divides by zero where a worker is alone in a round: skipped, with the reason.
    assert "divides by zero" in run["skipped"]["decent_dp/alternating-exp-ring"]
    assert "no topology 'allreduce'" in run["skipped"]["decent_dp/allreduce"]
    for name, r in results.items():
        assert r["median"] == pytest.approx(sorted(r["samples_per_s"])[0])  # one repeat: the median is it
        assert r["vs_local"] == pytest.approx(r["median"] / results["local"]["median"])
        assert r["vs_ddp"] == pytest.approx(r["median"] / results["ddp"]["median"])
    assert run["parameters"] == 32 * 32 + 32 + 32 * 10 + 10
    with Image.open(out / "throughput.png") as image:
        assert image.format == "PNG" and image.size[0] > 400
    assert "| decent_train/ring |" in proc.stdout


def test_benchmark_rate_without_root_says_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import benchmark
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(benchmark.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="--rate needs root and iproute2"):
        with benchmark.emulated_network("4gbit", None):
            pass


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="a network namespace per worker needs root and iproute2",
)
def test_benchmark_with_a_link_per_worker(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers=2", "--rate=10gbit", "--links=per-worker", "--width=32", "--depth=1",
         "--batch=8", "--steps=2", "--warmup=1", "--repeats=1", "--topologies=ring", f"--out={out}", "--timeout=200"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "results.json").read_text())
    assert summary["network"] == "a 10gbit link per worker"
    assert {"local", "ddp", "decent_train/ring", "decent_dp/ring"} == set(summary["runs"]["2"]["results"])
    assert "--rdzv-endpoint=10.213.0.1:29500" in proc.stdout and "--local-addr=10.213.0.2" in proc.stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in namespaces if re.fullmatch(r"db\d+(s|w\d+)", n)]  # every namespace it made is gone


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2",
)
def test_a_launch_over_its_time_is_stopped_and_its_namespaces_removed(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers=2", "--rate=10gbit", "--links=per-worker", "--width=32", "--depth=1",
         "--batch=8", "--steps=2", "--warmup=1", "--repeats=1", "--topologies=ring", f"--out={tmp_path}",
         "--timeout=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "the launch with 2 workers took over 3 s and was stopped" in proc.stderr
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in namespaces if re.fullmatch(r"db\d+(s|w\d+)", n)]
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftover, "a worker of the stopped launch is still running"


@pytest.mark.slow
def test_overhead_benchmark_runs_both_loops_on_cpu(tmp_path: Path) -> None:
    """The single-worker overhead mode, shrunk to run on CPU; on a GPU the defaults are ResNet-50 and GPT-2 small."""
    script = SCRIPT.parent / "bench_overhead.py"
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--device=cpu", "--precision=bf16", "--image-size=32", "--batch-resnet=2",
         "--batch-gpt=2", "--context=16", "--vocab=64", "--gpt-layers=1", "--gpt-heads=2", "--gpt-width=32",
         "--steps=2", "--warmup=1", "--repeats=2", f"--json={out}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"resnet50", "gpt2"}
    for r in results.values():
        paired = sorted(e / p for e, p in zip(r["engine_ms_all"], r["plain_ms_all"]))  # rounds compared in pairs
        assert len(paired) == 2 and r["engine_over_plain"] == pytest.approx((paired[0] + paired[1]) / 2)
        assert r["plain_ms"] > 0 and r["engine_ms"] > 0
    assert "| resnet50 |" in proc.stdout and "| gpt2 |" in proc.stdout


@pytest.mark.slow
def test_benchmark_runs_each_implementation_in_its_own_launch_in_turns(tmp_path: Path) -> None:
    """--launches separate: one launch per implementation and round, the implementations taking turns; the table is
    the median over rounds, with the optimizer, bucket size and per-phase profile asked for."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers=2", "--launches=separate", "--rounds=2", "--optim=adamw",
         "--bucket-mb=0.01", "--phases=2", "--width=32", "--depth=2", "--batch=8", "--steps=2", "--warmup=1",
         "--repeats=1", "--topologies=ring", "--only=decent_train/ring,ddp", f"--out={out}"],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr
    launched = re.findall(r"^\$ .* --only=(\S+) --json=\S+round(\d)\.json$", proc.stdout, re.MULTILINE)
    assert launched == [("decent_train/ring", "0"), ("ddp", "0"), ("decent_train/ring", "1"), ("ddp", "1")]
    for name, r in launched:
        single = json.loads((out / f"workers2.{name.replace('/', '_')}.round{r}.json").read_text())
        assert set(single["results"]) == {name}  # one implementation per launch
        assert single["setup"]["optim"] == "adamw" and single["setup"]["bucket_mb"] == 0.01
    run = json.loads((out / "results.json").read_text())["runs"]["2"]
    assert run["launches"] == "separate" and run["rounds"] == 2
    results = run["results"]
    assert set(results) == {"decent_train/ring", "ddp"}
    for name, r in results.items():
        rounds = [json.loads((out / f"workers2.{name.replace('/', '_')}.round{k}.json").read_text())["results"][name]
                  ["median"] for k in range(2)]
        assert r["samples_per_s"] == rounds and r["median"] == pytest.approx(sum(rounds) / 2)
        assert r["vs_ddp"] == pytest.approx(r["median"] / results["ddp"]["median"]) and r["vs_local"] is None
    phases = run["phases"]
    assert phases["decent_train/ring"]["mix"] > 0 and phases["ddp"]["mix"] == 0  # only the engine mixes
    assert phases["ddp"]["end of backward"] > 0  # DDP waits for its all-reduce there
    assert all(t >= 0 for p in phases.values() for t in p.values())
    assert "per-phase ms/step" in proc.stdout and "| decent_train/ring |" in proc.stdout


@pytest.mark.slow
def test_compression_benchmark_prints_every_compressor() -> None:
    """scripts/bench_compression.py on a small vector: each compressor's message size against float32 by hand."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "bench_compression.py"), "--workers=4", "--numel=4096", "--steps=3",
         "--blocks=64,256"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {line[:26].strip(): line[26:].split() for line in proc.stdout.splitlines()[2:]}
    assert float(rows["bf16"][0]) == 0.5 and float(rows["none"][0]) == 1.0
    assert float(rows["int8 block 64"][0]) == pytest.approx((4096 + 4 * 64) / (4 * 4096), abs=1e-4)
    assert float(rows["int8 block 256"][0]) == pytest.approx((4096 + 4 * 16) / (4 * 4096), abs=1e-4)
    assert {"int8-stochastic block 64", "int8-stochastic block 256"} <= set(rows)


@pytest.mark.slow
def test_time_to_accuracy_runs_real_jobs_and_reads_their_metrics(tmp_path: Path) -> None:
    """--time-to-accuracy: a real decent-train job per entry of --jobs; the time reported is that of the first
    evaluation at or above the target, as the job's own metrics.jsonl says."""
    out = tmp_path / "tta"
    train = ("model=mlp model.hidden_sizes=[32] dataset=digits steps=30 eval_every=10 seed=0 "
             "logger.wandb.mode=disabled logger.progress_bar=false checkpoint.every=0")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--time-to-accuracy=0.3", "--workers=2", "--jobs=ring-int8", f"--train={train}",
         f"--out={out}"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    job = json.loads((out / "time_to_accuracy.json").read_text())["jobs"]["ring-int8"]
    records = [json.loads(line) for line in (out / "ring-int8" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evaluated] == [10, 20, 30]
    first = next(r for r in evaluated if r["eval/accuracy"] >= 0.3)
    assert job["seconds_to_target"] == first["time/elapsed_s"] and job["step_at_target"] == first["step"]
    assert job["final_accuracy"] == json.loads((out / "ring-int8" / "result.json").read_text())["eval/accuracy"]
    assert job["bytes_per_step"] < 4 * (64 * 32 + 32 + 32 * 10 + 10) / 3  # int8: about a quarter of float32
    assert "| ring-int8 |" in proc.stdout
