"""Everything worth running on one GPU, in one invocation that passes or fails: the driver behind scripts/gpu_check.sh.

    bash scripts/gpu_check.sh [OUT_DIR]        # or: python scripts/gpu_check.py [OUT_DIR]   (default gpu_check_out/)

With a CUDA GPU it runs, in order, each step with its time limit inside a total budget (``GPU_CHECK_BUDGET_S``,
470 s: 8 minutes on one H100 with the start and the summary):

1. ``[env]`` the GPU, driver, torch / CUDA / cuDNN / NCCL versions;
2. ``[overhead-b256]``, ``[overhead-b64]`` scripts/bench_overhead.py on an idle GPU: the engine's step time against a
   plain loop, GPT-2 small (8 x 1024) and ResNet-50 (channels_last) at batch 256, ResNet-50 at batch 64, bf16; the
   median over 7 rounds of each round's engine / plain (on an H200, ResNet-50 at batch 64 is host-bound and one
   process's plain loop ran 17-26 ms/step: rounds compared in pairs cancel that drift); at batch 64 also the engine
   stepping each bucket inside backward, as a worker with peers does (``--variants in-backward``). Fails
   above ``OVERHEAD_BOUND`` (1.10: timing noise is not a defect, 10% is); the issue's targets (1.03, 1.03, 1.05) are
   reported met or missed;
3. ``[cli-job]`` the default job through the command line on the GPU (``launch=gpu``: one worker per GPU, NCCL). Fails
   unless it finishes with finite losses and the default job's accuracy (``CLI_ACCURACY``);
4. ``[tests]`` every ``gpu``-marked test in tests/ (``pytest -m gpu tests/``): the engine against its replay, bf16 and
   fp16, channels_last and torch.compile, peak memory (tests/test_gpu.py), the fronts and int8's Triton kernels
   (tests/test_gpu_fronts.py), pinned-memory batches (tests/test_device_batches.py), and processes sharing the GPU:
   whether NCCL accepts them with distinct NCCL_HOSTIDs (issue 37 part 5), then the engine and the fronts in 2 and 4
   processes on it, and an averaged resume's all-reduce on it (tests/test_gpu_resume.py). Fails on any failed test or
   collection error;
5. OUT_DIR/summary.md and summary.json: versions, every number, what failed; OUT_DIR/measurements.jsonl (the tests'
   measurements) and gpu_check.log (the whole console, written by gpu_check.sh). Nothing else goes into OUT_DIR: a
   device run returns at most 8 files.

A failing step is recorded and the next one still runs; the exit status is 1 if anything failed. Without a CUDA GPU it
prints ``no CUDA GPU: skip mode`` and the plan, shows the GPU tests skipping with their reason, writes a summary saying
so, and exits 0.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", 470))
PY = sys.executable
OVERHEAD_BOUND = 1.10  # engine / plain above this fails the check
OVERHEAD_RUNS = {"b256": ("resnet50,gpt2", 256), "b64": ("resnet50", 64)}  # run: (--models, --batch-resnet)
OVERHEAD_TARGETS = {("gpt2", "b256"): 1.03, ("resnet50", "b256"): 1.03, ("resnet50", "b64"): 1.05}  # issue 37
CLI_ACCURACY = 0.95  # the default job's bar (tests/test_sharded_launcher.py's); it ends near 0.99 on 4 CPU workers
TESTS_LIMIT_S = 330.0
SUMMARY_RESERVE_S = 10.0  # left for the summary when the tests take the rest of the budget
OUT_FILES = ("summary.md", "summary.json", "measurements.jsonl", "gpu_check.log")

ENV_PROBE = r"""
import json, sys
import torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    import torch.distributed as dist
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    p = torch.cuda.get_device_properties(0)
    info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
    info["capability"] = f"sm_{p.major}{p.minor}"
    info["cudnn"] = torch.backends.cudnn.version()
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None
    info["bf16_supported"] = torch.cuda.is_bf16_supported()
print("GPU_CHECK_ENV " + json.dumps(info))
"""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for a step, without a caller's GPU_CHECK_* test settings (the tests run on the GPU, their
    measurements go where the step says)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_DEVICE", "GPU_CHECK_OUT")}
    return env | {"PYTHONUNBUFFERED": "1"} | (extra or {})


@dataclass
class Step:
    key: str
    what: str
    argv: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"  # ok, FAILED (exit n), TIMED OUT after n s, not run (out of time), INTERRUPTED
    seconds: float = 0.0
    output: str = ""

    @property
    def command(self) -> str:
        if self.key == "env":
            return "python -c <env probe>"
        return shlex.join("python" if a == PY else str(a) for a in self.argv)


def plan(out: Path, scratch: Path) -> list[Step]:
    """The steps; ``scratch`` holds what only the summary reads (junit, the benchmark's JSON, the job's run dir)."""
    steps = [Step("env", "GPU, driver, torch / CUDA / cuDNN / NCCL versions (nvidia-smi, torch)", [PY, "-c", ENV_PROBE],
                  60)]
    for run, (models, batch) in OVERHEAD_RUNS.items():
        steps.append(Step(
            f"overhead-{run}",
            f"scripts/bench_overhead.py: engine step time vs a plain loop, {models.replace(',', ' and ')} (ResNet-50 "
            f"batch {batch}, channels_last; GPT-2 small 8 x 1024), bf16; fails above {OVERHEAD_BOUND:.2f}x",
            [PY, "scripts/bench_overhead.py", "--device", "cuda", "--models", models, "--precision", "bf16",
             "--batch-resnet", str(batch), "--batch-gpt", "8", "--context", "1024", "--repeats", "7",
             *(["--variants", "in-backward"] if run == "b64" else []), "--json", str(scratch / f"overhead_{run}.json")],
            150 if run == "b256" else 75))
    steps.append(Step(
        "offload", "scripts/bench_offload.py: Streaming DiLoCo (8 x Linear(4096), 4 fragments, H=8, τ=1) with its "
        "outer state on the device and offloaded: the front's device bytes, peak memory over the model's, step times",
        [PY, "scripts/bench_offload.py", "--device", "cuda", "--width", "4096", "--layers", "8",
         "--out", str(scratch / "offload.json")], 90))
    steps.append(Step(
        "cli-job", f"the default job through the command line on the GPU (launch=gpu, NCCL); fails below accuracy "
        f"{CLI_ACCURACY} or on a non-finite loss",
        [PY, "-m", "decent_train.launcher.cli", "launch=gpu", "logger.progress_bar=false", "logger.wandb.mode=disabled",
         f"hydra.run.dir={scratch / 'cli_job'}"], 120))
    steps.append(Step(
        "tests", "every gpu-marked test in tests/: engine vs replay, bf16/fp16, channels_last + compile, peak memory, "
        "the fronts and int8's Triton kernels vs their CPU replays, processes sharing the GPU (NCCL_HOSTID or gloo)",
        [PY, "-m", "pytest", "-v", "-s", "-m", "gpu", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         f"--junitxml={scratch / 'junit.xml'}", "tests/"],
        TESTS_LIMIT_S, {"GPU_CHECK_OUT": str(out)}))
    return steps


SUMMARY_STEP = ("[summary] OUT_DIR/summary.md and summary.json: versions, each step, every test, engine/plain per model "
                f"(fails above {OVERHEAD_BOUND:.2f}x; targets reported), the one-GPU processes' backend, peak memory, "
                "what failed")


def run_step(step: Step, deadline: float) -> None:
    """Run one step, its output to the console (gpu_check.sh copies the console to OUT/gpu_check.log)."""
    remaining = deadline - time.monotonic()
    if remaining < 15:
        step.status = "not run (out of time)"
        print(f"\n=== [{step.key}] not run: {remaining:.0f} s of the budget left", flush=True)
        return
    limit = min(step.limit_s, remaining)
    print(f"\n=== [{step.key}] {step.command}  (limit {limit:.0f} s)", flush=True)
    start = time.monotonic()
    step.status = "INTERRUPTED"  # until it ends
    chunks: list[str] = []
    proc = subprocess.Popen(step.argv, cwd=ROOT, env=child_env(step.env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def tee() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            chunks.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    rc: int | None = None
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:  # over its limit, or this driver is being stopped
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group (its workers too)
            proc.wait()
        reader.join(timeout=10)
        step.output = "".join(chunks)
    step.seconds = time.monotonic() - start
    step.status = "ok" if rc == 0 else f"TIMED OUT after {limit:.0f} s" if rc is None else f"FAILED (exit {rc})"
    print(f"=== [{step.key}] {step.status} in {step.seconds:.1f} s", flush=True)


def nvidia_smi(full: bool = False) -> str:
    """One line per GPU (name, driver, memory, power limit), or with ``full`` nvidia-smi's whole table."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not found"
    query = ["--query-gpu=name,driver_version,memory.total,power.limit", "--format=csv,noheader"]
    try:
        result = subprocess.run(["nvidia-smi", *([] if full else query)], capture_output=True, text=True, timeout=30)
        return result.stdout.strip() or result.stderr.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi: {error}"


def parse_env(output: str) -> dict[str, Any]:
    for line in output.splitlines():
        if line.startswith("GPU_CHECK_ENV "):
            return json.loads(line.removeprefix("GPU_CHECK_ENV "))
    return {}


# -- the decisions (tests/test_gpu_check.py feeds them made-up results) -------------------------------------------
def parse_junit(path: Path) -> dict[str, Any]:
    """Each test's outcome from pytest's junit XML (collection errors included), counted."""
    result: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "tests": []}
    if not path.exists():
        return result
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, note = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                note = ((child.get("message") or child.tag).strip().splitlines() or [child.tag])[0][:300]
            elif child.tag == "skipped":
                outcome, note = "skipped", (child.get("message") or "").strip()[:300]
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        result[outcome] += 1
        result["tests"].append({"name": f"{module}::{case.get('name', '?')}", "outcome": outcome,
                                "seconds": float(case.get("time", 0)), "note": note})
    return result


TEST_ID = re.compile(r"^(tests/\S+::\S+)(.*)$")
OUTCOME = re.compile(r"^\s*(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
OUTCOMES = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "failed", "SKIPPED": "skipped",
            "XFAIL": "skipped"}


def parse_verbose(output: str) -> dict[str, Any]:
    """The outcomes ``pytest -v -s`` printed, for a run stopped before it wrote its junit XML: a test's id starts a
    line, its outcome follows on that line or, after what the test printed, at the start of a later one."""
    result: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "tests": []}
    current = None
    for line in output.splitlines():
        named = TEST_ID.match(line)
        if named:
            current, line = named.group(1), named.group(2)
        found = OUTCOME.match(line)
        if current and found:
            outcome = OUTCOMES[found.group(1)]
            result[outcome] += 1
            result["tests"].append({"name": current, "outcome": outcome, "seconds": 0.0, "note": ""})
            current = None
    return result


def judge_overhead(runs: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (model, run) with a target: engine / plain, the target and the bound; and the failures (a ratio
    above ``OVERHEAD_BOUND``, or no result)."""
    rows, failures = [], []
    for (model, run), target in OVERHEAD_TARGETS.items():
        result = runs.get(run, {}).get("results", {}).get(model)
        batch = OVERHEAD_RUNS[run][1] if model == "resnet50" else 8
        if not result:
            failures.append(f"overhead: no result for {model} (batch {batch}): see [overhead-{run}] in gpu_check.log")
            continue
        ratio = result["engine_over_plain"]  # the median of the rounds' ratios (bench_overhead.py)
        row = {"model": model, "run": run, "batch": batch, "plain_ms": result["plain_ms"],
               "engine_ms": result["engine_ms"], "engine_over_plain": ratio, "target": target,
               "target_met": ratio <= target, "within_bound": ratio <= OVERHEAD_BOUND,
               "plain_ms_all": result.get("plain_ms_all"), "engine_ms_all": result.get("engine_ms_all"),
               "in_backward_over_plain": result.get("in-backward_over_plain")}
        rows.append(row)
        if not math.isfinite(ratio) or ratio > OVERHEAD_BOUND:
            failures.append(f"overhead: {model} batch {batch}: engine {ratio:.3f}x the plain loop, above the bound "
                            f"{OVERHEAD_BOUND:.2f}x")
    return rows, failures


def judge_cli_job(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The default job's result: finished (result.json), finite losses, accuracy at least ``CLI_ACCURACY``."""
    try:
        result = json.loads((run_dir / "result.json").read_text())
        losses = [json.loads(line).get("train/loss") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if line.strip()]
    except (OSError, ValueError) as error:
        return {"finished": False, "error": str(error)}, [f"cli-job: no result ({error})"]
    losses = [v for v in losses if v is not None]
    job = {"finished": True, "accuracy": result.get("eval/accuracy"), "final_loss": losses[-1] if losses else None,
           "losses_finite": bool(losses) and all(math.isfinite(v) for v in losses), "steps": result.get("steps"),
           "world_size": result.get("world_size"), "wall_time_s": result.get("wall_time_s"),
           "samples_per_s": result.get("throughput/samples_per_s")}
    failures = []
    if not job["losses_finite"]:
        failures.append(f"cli-job: the training losses are not all finite ({len(losses)} records)")
    if not isinstance(job["accuracy"], (int, float)) or job["accuracy"] < CLI_ACCURACY:
        failures.append(f"cli-job: accuracy {job['accuracy']} below the default job's {CLI_ACCURACY}")
    return job, failures


def judge(steps: list[Step], tests: dict[str, Any], overhead: list[str], cli: list[str]) -> list[str]:
    """Everything that fails the check: a step that did not end ok, a failed test (or none ran), the overhead's and
    the job's failures."""
    failures = [f"step [{s.key}]: {s.status}" for s in steps if s.status != "ok"]
    failures += [f"test {t['name']}: {t['note']}" for t in tests["tests"] if t["outcome"] == "failed"]
    if not tests["tests"]:
        failures.append("tests: no test results (junit.xml nor pytest -v lines)")
    return failures + overhead + cli


# -- the summary --------------------------------------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def one_gpu_lines(measurements: list[dict[str, Any]]) -> list[str]:
    """Part 5's outcome, from tests/test_gpu.py's record."""
    found = next((m for m in measurements if m["test"] == "one-gpu/nccl-hostid"), None)
    if found is None:
        return ["(not run: see the tests' log)"]
    lines = [f"- NCCL, 2 ranks on GPU 0, a distinct NCCL_HOSTID each: **{found.get('with_hostid')}**",
             f"- the same without NCCL_HOSTID (the control): {found.get('without_hostid')}",
             f"- backend of the one-GPU tests: **{found.get('backend')}**"]
    if found.get("unexercised"):
        lines.append(f"- unexercised with gloo: {found['unexercised']}")
    for m in measurements:
        if m["test"].startswith("one-gpu/") and m["test"] != "one-gpu/nccl-hostid":
            lines.append(f"- {m['test']}: " + ", ".join(f"{k} {v}" for k, v in m.items() if k not in ("test", "device")))
    return lines


def memory_lines(measurements: list[dict[str, Any]]) -> list[str]:
    rows = [m for m in measurements if m["test"].startswith("memory/")]
    if not rows:
        return ["(no measurement: see the tests' log)"]
    lines = ["| measurement | parameters | plain loop peak | peak | above plain / parameters | plain + one fragment |",
             "|---|---|---|---|---|---|"]
    for m in rows:
        peak = m.get("front_peak", m.get("engine_peak", 0))
        met = m.get("target_plain_plus_one_fragment_met")
        lines.append(f"| {m['test']} | {mib(m['param_bytes'])} | {mib(m['plain_peak'])} | {mib(peak)} | "
                     f"{m['extra_peak_over_param_bytes']:.2f} | {'' if met is None else 'met' if met else 'missed'} |")
    return lines


def offload_lines(result: dict[str, Any]) -> list[str]:
    """scripts/bench_offload.py's medians, on the device against offloaded (reported; the memory targets are the
    tests')."""
    summary = result.get("summary") or {}
    if not summary:
        return ["(no result: see the offload step in gpu_check.log)"]
    lines = ["| outer state | model | front on device, max | in an outer step | front in host memory | peak over the "
             "model | inner step ms | step with an outer step ms | step ms, unsynchronized |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run, m in summary.items():
        steady = m.get("steady_step_ms")
        lines.append(f"| {run} | {m['model_mib']:.0f} MiB | {m['front_device_mib_max']:.0f} MiB | "
                     f"{m.get('front_device_mib_max_in_outer_step', 0):.0f} MiB | {m['front_host_mib_max']:.0f} MiB | "
                     f"{m['peak_over_model_mib'] or 0:.0f} MiB | {m['inner_step_ms']:.2f} | "
                     f"{m['step_with_outer_ms']:.2f} | {'-' if steady is None else f'{steady:.2f}'} |")
    return lines


def write_summary(out: Path, steps: list[Step], env: dict[str, Any], smi: str, started: float, scratch: Path
                  ) -> tuple[bool, str]:
    tests = parse_junit(scratch / "junit.xml")
    test_step = next(s for s in steps if s.key == "tests")
    if not tests["tests"]:
        tests = parse_verbose(test_step.output)
    runs = {run: read_json(scratch / f"overhead_{run}.json") for run in OVERHEAD_RUNS}
    overhead, overhead_failures = judge_overhead(runs)
    cli, cli_failures = judge_cli_job(scratch / "cli_job")
    measurements = read_jsonl(out / "measurements.jsonl")
    failures = judge(steps, tests, overhead_failures, cli_failures)
    ok = not failures
    gpus = env.get("gpus") or []
    lines = [
        f"# GPU check: {'passed' if ok else 'FAILED'}", "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; {time.monotonic() - started:.0f} s of a {BUDGET_S:.0f} s "
        "budget; `bash scripts/gpu_check.sh` (scripts/gpu_check.py); the console: gpu_check.log", "",
        f"- GPU: {', '.join(gpus) or '?'} ({len(gpus)} visible, {env.get('gpu_memory_gib', '?')} GiB, "
        f"{env.get('capability', '?')}); nvidia-smi (name, driver, memory, power limit): {smi}",
        f"- driver {env.get('driver', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, cuDNN "
        f"{env.get('cudnn', '?')}, "
        f"NCCL {env.get('nccl', '?')}, Python {env.get('python', '?')}", "",
        "## Failures", "", *([f"- {f}" for f in failures] or ["none"]), "",
        "## Steps", "", "| step | result | seconds |", "|---|---|---|",
        *[f"| {s.key} | {s.status} | {s.seconds:.1f} |" for s in steps], "",
        f"## Engine step time vs a plain loop (bf16; fails above {OVERHEAD_BOUND:.2f}x; the issue's targets)", "",
        "| model | batch | plain ms/step | engine ms/step | engine / plain | target | target | each bucket inside "
        "backward / plain |", "|---|---|---|---|---|---|---|---|",
        *[f"| {o['model']} | {o['batch']} | {o['plain_ms']:.1f} | {o['engine_ms']:.1f} | {o['engine_over_plain']:.3f}x | "
          f"{o['target']:.2f}x | {'met' if o['target_met'] else 'MISSED'} | "
          f"{'' if o['in_backward_over_plain'] is None else format(o['in_backward_over_plain'], '.3f') + 'x'} |"
          for o in overhead],
        *([] if overhead else ["(no results: see the overhead steps in gpu_check.log)"]), "",
        "## More than one process on one GPU (issue 37 part 5)", "", *one_gpu_lines(measurements), "",
        "## Peak device memory against a plain loop", "", *memory_lines(measurements), "",
        "## Streaming DiLoCo's outer state: on the device and offloaded (scripts/bench_offload.py)", "",
        *offload_lines(read_json(scratch / "offload.json")), "",
        "## The default job through the command line (launch=gpu)", "",
        "- " + ", ".join(f"{k} {v}" for k, v in cli.items()), "",
        f"## Tests (pytest -m gpu tests/): {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} "
        "skipped or xfailed", "", "| test | result | seconds | note |", "|---|---|---|---|",
        *[f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {t['note'].replace('|', '/')} |"
          for t in tests["tests"]], "",
        "## Measurements the tests printed", "",
        *([f"- `{json.dumps(m, separators=(',', ':'))}`" for m in measurements] or ["(none)"]),
    ]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({
        "passed": ok, "failures": failures, "env": env, "nvidia_smi": smi, "budget_s": BUDGET_S,
        "steps": [dict(key=s.key, status=s.status, seconds=round(s.seconds, 1), command=s.command) for s in steps],
        "overhead": overhead, "overhead_bound": OVERHEAD_BOUND, "overhead_raw": runs, "cli_job": cli,
        "offload": read_json(scratch / "offload.json").get("summary"),
        "tests": tests, "measurements": measurements,
    }, indent=2, default=str) + "\n")
    return ok, text


def skip_mode(out: Path, steps: list[Step], env: dict[str, Any]) -> int:
    print("no CUDA GPU: skip mode")
    print(f"torch {env.get('torch', '?')} sees no CUDA device; on a CUDA GPU this would run, within {BUDGET_S:.0f} s:")
    planned = [f"{i}. [{s.key}] {s.what}\n     $ {s.command}" for i, s in enumerate(steps, 1)]
    planned.append(f"{len(steps) + 1}. {SUMMARY_STEP}")
    for line in planned:
        print(line)
    print("\nThe GPU machine's command (wheels, then this script): the header of scripts/gpu_check.sh.")
    print("\nThe GPU tests, skipped here with their reason:", flush=True)
    argv = [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/"]
    print(f"$ {shlex.join(['python', *argv[1:]])}", flush=True)
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired as error:
        partial = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else error.stdout or ""
        proc = subprocess.CompletedProcess(argv, 124, f"{partial}\npytest took over 300 s\n")
    print(proc.stdout, flush=True)
    (out / "summary.md").write_text("\n".join([
        "# GPU check: skip mode (no CUDA GPU)", "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; torch {env.get('torch', '?')} sees no CUDA device. "
        "On a CUDA GPU `bash scripts/gpu_check.sh` would run:", "",
        *planned, "",
        f"## The GPU tests here (pytest exit {proc.returncode})", "", "```", proc.stdout.strip(), "```", "",
    ]))
    if proc.returncode != 0:
        print(f"gpu_check: pytest exited {proc.returncode} in skip mode (the tests should only skip)", file=sys.stderr)
    return 0 if proc.returncode == 0 else 1


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: bash scripts/gpu_check.sh [OUT_DIR]   (default gpu_check_out/)", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = started + BUDGET_S - SUMMARY_RESERVE_S
    out = Path(argv[0] if argv else "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in OUT_FILES[:-1]:  # gpu_check.log is being written by gpu_check.sh
        (out / stale).unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    steps = plan(out, scratch)

    probe_start = time.monotonic()
    try:
        probe = subprocess.run([PY, "-c", ENV_PROBE], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                               timeout=120)
        env, problem = parse_env(probe.stdout), probe.stdout + probe.stderr
    except subprocess.TimeoutExpired:
        env, problem = {}, "python -c 'import torch; torch.cuda...' took over 120 s"
    if not env:
        print(f"gpu_check: torch does not import or answer:\n{problem}", file=sys.stderr)
        (out / "summary.md").write_text(
            f"# GPU check: FAILED\n\ntorch does not import or answer:\n\n```\n{problem}\n```\n")
        return 1
    if not env["cuda_available"]:
        return skip_mode(out, steps, env)

    smi = nvidia_smi()
    fields = [f.strip() for f in smi.splitlines()[0].split(",")] if smi else []
    env["driver"] = fields[1] if len(fields) > 1 else "?"  # name, driver_version, memory.total, power.limit
    print(f"CUDA GPU: {', '.join(env['gpus'])}; nvidia-smi: {smi}")
    print(f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, NCCL {env['nccl']}; "
          f"budget {BUDGET_S:.0f} s; out: {out}; scratch: {scratch}", flush=True)
    print(nvidia_smi(full=True), flush=True)
    steps[0].status, steps[0].seconds = "ok", time.monotonic() - probe_start  # the probe above was this step

    def stop(signum: int, frame: Any) -> None:  # stopped from outside: still write what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        for step in steps[1:]:
            run_step(step, deadline)
    except KeyboardInterrupt as stopped:
        print(f"\ngpu_check: stopped ({stopped or 'interrupt'}); writing the summary of what ran", flush=True)
    ok, text = write_summary(out, steps, env, smi, started, scratch)
    print(f"\n=== [summary] {out / 'summary.md'}\n\n{text}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
