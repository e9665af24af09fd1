"""scripts/bench_local_steps.py: the table's arithmetic (bytes and training seconds to a target, ratios to the
reference) on synthetic metrics, the configurations it runs, and one real run of the command, shrunk (timings are
never asserted: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from tests.jobs import import_script, records

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_local_steps.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    return import_script("bench_local_steps")


def record(step: int, bytes_per_step: float, step_ms: float, accuracy: float | None = None, **more: Any) -> dict:
    r = {"step": step, "comm/bytes_per_step": bytes_per_step, "time/step_ms": step_ms, "time/elapsed_s": step / 10,
         "train/loss": 1.0, **more}
    if accuracy is not None:
        r |= {"eval/accuracy": accuracy, "eval/loss": 1 - accuracy}
    return r


def test_curve_sums_bytes_and_seconds_over_the_steps_each_record_covers(bench: Any) -> None:
    logged = [
        {"info": "not a record"},
        record(10, 1000.0, 20.0),  # no evaluation: counted, not a point
        record(14, 1000.0, 50.0, **{"consensus/distance": 0.1}),  # an odd window (a consensus record)
        record(20, 500.0, 10.0, accuracy=0.5),
        record(30, 2000.0, 100.0, accuracy=0.75),
    ]
    points = bench.curve(logged)
    assert [p.step for p in points] == [20, 30]
    assert points[0].bytes_per_worker == 10 * 1000 + 4 * 1000 + 6 * 500
    assert points[1].bytes_per_worker == 17_000 + 10 * 2000
    assert points[0].train_s == pytest.approx((10 * 20 + 4 * 50 + 6 * 10) / 1000)
    assert points[1].train_s == pytest.approx(0.46 + 1.0)
    assert (points[1].accuracy, points[1].loss, points[1].elapsed_s) == (0.75, 0.25, 3.0)


def synthetic_curves(bench: Any) -> dict[str, list[Any]]:
    P = bench.Point
    return {
        # step, bytes per worker, training s, elapsed s, accuracy, loss
        "ddp": [P(10, 100.0, 10.0, 11, 0.8, 0.5), P(20, 200.0, 20.0, 22, 0.90, 0.3), P(30, 300.0, 30.0, 33, 0.9, 0.2)],
        "diloco": [P(10, 5.0, 2.0, 3, 0.70, 0.6), P(20, 10.0, 4.0, 5, 0.92, 0.2), P(30, 15.0, 6.0, 7, 0.91, 0.25)],
        "ring": [P(10, 60.0, 8.0, 9, 0.60, 0.9), P(20, 120.0, 16.0, 17, 0.85, 0.4), P(30, 180.0, 24.0, 25, 0.88, 0.35)],
    }


def test_summary_bytes_and_seconds_to_the_reference_accuracy(bench: Any) -> None:
    summary = bench.summarize(synthetic_curves(bench), "ddp")
    assert summary["target"] == 0.90 and summary["reference_final"] == 0.90
    ddp, diloco, ring = (summary["rows"][k] for k in ("ddp", "diloco", "ring"))
    # DDP reaches its own final accuracy at step 20, before the end: its bytes and seconds to it are those of step 20.
    assert (ddp["step_at_target"], ddp["bytes_to_target"], ddp["train_s_to_target"]) == (20, 200.0, 20.0)
    assert ddp["bytes_to_target_vs_reference"] == 1.0 and ddp["vs_reference"] == 0.0
    assert (diloco["step_at_target"], diloco["bytes_to_target"], diloco["train_s_to_target"]) == (20, 10.0, 4.0)
    assert diloco["bytes_to_target_vs_reference"] == pytest.approx(10.0 / 200.0)  # 20x fewer
    assert diloco["train_s_to_target_vs_reference"] == pytest.approx(4.0 / 20.0)
    assert diloco["vs_reference"] == pytest.approx(1.0) and diloco["best"] == 0.92
    assert diloco["bytes_vs_reference"] == pytest.approx(15.0 / 300.0)
    assert diloco["train_s_vs_reference"] == pytest.approx(6.0 / 30.0)
    assert diloco["short_of_target"] is None
    # Not reached: by how much the best evaluation fell short, and nothing to the target.
    assert not ring["reached"] and ring["short_of_target"] == pytest.approx(2.0)
    assert ring["bytes_to_target"] is None and ring["bytes_to_target_vs_reference"] is None
    assert ring["vs_reference"] == pytest.approx(-2.0)
    text = bench.table(summary)
    assert "| diloco | 0.9100 (+1.0 pt) |" in text and "(20.0x fewer) | 4.0 (0.20x) |" in text
    assert "| ring | 0.8800 (-2.0 pt) |" in text and "not reached: best 0.8800, 2.0 pt short" in text


def test_summary_with_a_stated_target(bench: Any) -> None:
    summary = bench.summarize(synthetic_curves(bench), "ddp", target=0.85)
    rows = summary["rows"]
    assert summary["target"] == 0.85 and summary["reference_final"] == 0.90
    assert rows["ddp"]["step_at_target"] == 20 and rows["ring"]["step_at_target"] == 20
    assert rows["ring"]["bytes_to_target_vs_reference"] == pytest.approx(120.0 / 200.0)
    assert rows["ring"]["train_s_to_target_vs_reference"] == pytest.approx(16.0 / 20.0)
    # A target the reference never reaches: others' bytes to it are reported, without a ratio.
    summary = bench.summarize(synthetic_curves(bench), "ddp", target=0.915)
    assert not summary["rows"]["ddp"]["reached"] and summary["rows"]["diloco"]["bytes_to_target"] == 10.0
    assert summary["rows"]["diloco"]["bytes_to_target_vs_reference"] is None


def test_summary_on_the_loss_and_failed_runs(bench: Any) -> None:
    """--metric loss: the reference's final loss is the target, reached at or below it; a failed run is a row."""
    summary = bench.summarize(synthetic_curves(bench), "ddp", metric="loss")
    rows = summary["rows"]
    assert summary["target"] == 0.2 and summary["metric"] == "loss"
    assert rows["ddp"]["step_at_target"] == 30 and rows["diloco"]["step_at_target"] == 20
    assert rows["diloco"]["bytes_to_target_vs_reference"] == pytest.approx(10.0 / 300.0)
    assert rows["diloco"]["vs_reference"] == pytest.approx(0.05) and rows["diloco"]["best"] == 0.2
    assert not rows["ring"]["reached"] and rows["ring"]["short_of_target"] == pytest.approx(0.15)
    summary["failed"] = {"broken": "decent-train: error: worker rank 0 failed"}
    text = bench.table(summary)
    assert "| ring | 0.3500 (+0.150) |" in text and "not reached: best 0.3500, 0.150 short" in text
    assert "| diloco | 0.2500 (+0.050) |" in text and "(30.0x fewer)" in text
    assert "| broken | failed: decent-train: error: worker rank 0 failed |" in text


def test_every_configuration_is_a_recipe_option_and_the_sweep_runs_them_all(bench: Any) -> None:
    root = SCRIPT.parents[1]
    assert all((root / "recipes" / "local_steps" / f"{name}.yaml").is_file() for name in bench.CONFIGS)
    recipe = yaml.safe_load((root / "recipes" / "local_steps_study.yaml").read_text())
    assert recipe["hydra"]["sweeper"]["params"]["+local_steps"].split(",") == bench.CONFIGS
    assert set(bench.CONFIGS) == {p.stem for p in (root / "recipes" / "local_steps").glob("*.yaml")}  # all of them


@pytest.mark.slow
def test_the_command_runs_real_jobs_and_its_table_is_their_metrics(tmp_path: Path, bench: Any) -> None:
    """No emulated link; 2 workers, a tiny MLP, 6 steps: DDP and per-step ring gossip through ``decent-train``."""
    out = tmp_path / "bench"
    shrink = "launch.nproc_per_node=2 model.hidden_sizes=[16] steps=6 eval_every=2 logger.log_every=2"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--configs=ddp,ring", f"--set={shrink}", "--target=0.0", f"--out={out}",
         "--variant", "ring-lr", "ring", "optim.lr=0.01", "env:DECENT_TRAIN_COMPILED_INT8=never"],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "+local_steps=ddp" in proc.stdout and "+local_steps=ring optim.lr=0.01" not in proc.stdout
    assert f"{shrink} optim.lr=0.01 hydra.run.dir={out / 'ring-lr'}" in proc.stdout
    assert f"$ env DECENT_TRAIN_COMPILED_INT8=never {bench.COMMAND} -cn local_steps_study +local_steps=ring " in proc.stdout
    summary = json.loads((out / "local_steps.json").read_text())
    assert set(summary["rows"]) == {"ddp", "ring", "ring-lr"} and summary["network"] == "loopback (no emulation)"
    for name in summary["rows"]:
        logged = [r for r in records(out / name) if "comm/bytes_per_step" in r]
        assert [r["step"] for r in logged] == [2, 4, 6]
        sent = sum(2 * r["comm/bytes_per_step"] for r in logged)
        assert summary["curves"][name][-1]["bytes_per_worker"] == pytest.approx(sent)
        result = json.loads((out / name / "result.json").read_text())
        assert summary["rows"][name]["final_accuracy"] == result["eval/accuracy"]
        assert summary["rows"][name]["step_at_target"] == 2  # the first evaluation, any accuracy >= 0
    parameters = 64 * 16 + 16 + 16 * 10 + 10
    ddp = summary["curves"]["ddp"][-1]["bytes_per_worker"]
    assert ddp == pytest.approx(6 * 4 * parameters)  # 2 workers: 2(n-1)/n = 1 model per step, float32
    # a pair sends its bucket (the model, and the engine's alignment padding) per step
    assert summary["curves"]["ring"][-1]["bytes_per_worker"] == pytest.approx(ddp, rel=0.05)
    with Image.open(out / "local_steps.png") as image:
        assert image.format == "PNG" and image.size[0] > 1000
    assert "| ring-lr |" in proc.stdout
    again = subprocess.run([sys.executable, str(SCRIPT), f"--from={out}", "--target=0.0"], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("| configuration")[1] == proc.stdout.split("| configuration")[1].split("written:")[0]
    assert json.loads((out / "local_steps.json").read_text()) == summary  # --from reads, never rewrites


def test_the_token_setting_writes_the_stdlib_bytes_as_tokens(tmp_path: Path, bench: Any) -> None:
    """--setting tokens: train.bin and val.bin in dataset=tokens' format, every val_every-th module held out."""
    import sysconfig

    import numpy as np

    root = bench.prepare_bytes(tmp_path / "bytes", val_every=20, val_tokens=1000)
    train = np.fromfile(root / "train.bin", dtype="<u2")
    val = np.fromfile(root / "val.bin", dtype="<u2")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    assert len(val) == 1000 and bytes(val.astype(np.uint8)) == files[0].read_bytes()[:1000]
    assert bytes(train[:100].astype(np.uint8)) == files[1].read_bytes()[:100]
    assert len(train) == sum(f.stat().st_size for i, f in enumerate(files) if i % 20)
    assert train.max() < 256 and "dataset.vocab_size=256" in bench.TOKENS
