"""Everything worth running on one GPU, in one invocation, and one summary: the driver behind scripts/gpu_check.sh.

    bash scripts/gpu_check.sh [OUT_DIR]        # or: python scripts/gpu_check.py [OUT_DIR]   (default gpu_check_out/)

With a CUDA GPU it runs, in order and each with its time limit inside a total budget (``GPU_CHECK_BUDGET_S``, 540 s:
one 10-minute command with room to spare):

1. ``[env]`` the GPU, driver, torch / CUDA / cuDNN / NCCL versions;
2. ``[tests]`` ``python -m pytest -q -m gpu -s tests/test_gpu.py`` (see that file);
3. ``[overhead-bf16]`` ``scripts/bench_overhead.py`` on ResNet-50 and GPT-2 small in bf16;
4. ``[overhead-fp16]`` the same on ResNet-50 in fp16 with a GradScaler;
5. ``[summary]`` OUT_DIR/summary.md (and summary.json): versions, tests passed / failed / skipped, the engine's step
   time against a plain loop per model (target: at most 2% slower), peak memory of the engine against a plain loop,
   and what failed.

A failing step is recorded and the next one still runs; the exit status is 1 if any step or test failed. Without a
CUDA GPU it prints ``no CUDA GPU: skip mode`` and the plan, runs the GPU tests to show them skipping with their reason,
writes a summary saying so, and exits 0. A missed 2% overhead target is reported, not counted as a failure (timing
noise on a shared machine is not a defect).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", 540))
OVERHEAD_TARGET = 0.02
PY = sys.executable

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
    """This environment for a step, without a caller's GPU_CHECK_DEVICE (tests on the CPU) or GPU_CHECK_OUT."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_DEVICE", "GPU_CHECK_OUT")}
    return env | (extra or {})


@dataclass
class Step:
    key: str
    what: str
    argv: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"  # ok, FAILED (exit n), TIMED OUT after n s, not run (out of time), INTERRUPTED
    seconds: float = 0.0
    log: str = ""

    @property
    def command(self) -> str:
        if self.key == "env":
            return "python -c <env probe>"
        return shlex.join("python" if a == PY else str(a) for a in self.argv)


def plan(out: Path) -> list[Step]:
    bench = [PY, "scripts/bench_overhead.py", "--device", "cuda", "--steps", "20", "--warmup", "5", "--repeats", "3"]
    return [
        Step("env", "GPU, driver, torch / CUDA / cuDNN / NCCL versions (nvidia-smi, torch)", [PY, "-c", ENV_PROBE], 60),
        Step(
            "tests",
            "tests/test_gpu.py: the engine at world size 1 on CUDA vs the replay (SGD, AdamW; fp64, fp32); bf16 and "
            "fp16 + GradScaler steps (overflow skipped like a plain loop); peak memory engine vs plain loop "
            "(ResNet-50 bf16); channels_last + torch.compile on ResNet-18 and GPT-2, GPT-2 small 12x768: engine == "
            "plain loop; NCCL with 2 processes vs the replay (if 2+ GPUs)",
            [PY, "-m", "pytest", "-q", "-m", "gpu", "-s", "-p", "no:cacheprovider", "tests/test_gpu.py",
             f"--junitxml={out / 'junit.xml'}"],
            330,
            {"GPU_CHECK_OUT": str(out)},
        ),
        Step(
            "overhead-bf16",
            "scripts/bench_overhead.py: engine step time vs a plain loop, ResNet-50 (224 px, batch 64, channels_last) "
            "and GPT-2 small (context 1024, batch 8), bf16, AdamW",
            [*bench, "--models", "resnet50,gpt2", "--precision", "bf16", "--json", str(out / "overhead_bf16.json")],
            180,
        ),
        Step(
            "overhead-fp16",
            "scripts/bench_overhead.py: the same on ResNet-50 in fp16 with a GradScaler",
            [*bench, "--models", "resnet50", "--precision", "fp16", "--json", str(out / "overhead_fp16.json")],
            120,
        ),
    ]


SUMMARY_STEP = "[summary] write OUT_DIR/summary.md and summary.json: versions, tests passed/failed/skipped, engine "
SUMMARY_STEP += f"overhead per model (target <= {OVERHEAD_TARGET:.0%}), peak memory engine vs plain loop, failures"


def run_step(step: Step, out: Path, deadline: float) -> str:
    """Run one step, its output to the console and OUT/<key>.log; returns the output."""
    remaining = deadline - time.monotonic()
    if remaining < 15:
        step.status = "not run (out of time)"
        print(f"\n=== [{step.key}] not run: {remaining:.0f} s of the budget left", flush=True)
        return ""
    limit = min(step.limit_s, remaining)
    log_path = out / f"{step.key}.log"
    step.log = log_path.name
    print(f"\n=== [{step.key}] {step.command}  (limit {limit:.0f} s)", flush=True)
    start = time.monotonic()
    step.status = "INTERRUPTED"  # until it ends
    chunks: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(step.argv, cwd=ROOT, env=child_env(step.env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

        def tee() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                chunks.append(line)
                log.write(line)
                log.flush()
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
    step.seconds = time.monotonic() - start
    step.status = "ok" if rc == 0 else f"TIMED OUT after {limit:.0f} s" if rc is None else f"FAILED (exit {rc})"
    print(f"=== [{step.key}] {step.status} in {step.seconds:.1f} s", flush=True)
    return "".join(chunks)


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


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and each test's outcome from pytest's junit XML."""
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
                outcome, note = "skipped", (child.get("message") or "").strip()
        result[outcome] += 1
        result["tests"].append({"name": case.get("name", "?"), "outcome": outcome,
                                "seconds": float(case.get("time", 0)), "note": note})
    return result


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def write_summary(out: Path, steps: list[Step], env: dict[str, Any], smi: str, started: float) -> tuple[bool, str]:
    tests = parse_junit(out / "junit.xml")
    measurements = read_jsonl(out / "measurements.jsonl")
    overhead = []
    for precision in ("bf16", "fp16"):
        for model, r in read_json(out / f"overhead_{precision}.json").get("results", {}).items():
            extra = r["engine_ms"] / r["plain_ms"] - 1
            overhead.append(dict(model=model, precision=precision, plain_ms=r["plain_ms"], engine_ms=r["engine_ms"],
                                 overhead=extra, within_target=extra <= OVERHEAD_TARGET))
    memory = next((m for m in measurements if m["test"].startswith("memory/")), None)

    failures = [f"step [{s.key}]: {s.status}" for s in steps if s.status != "ok"]
    failures += [f"test {t['name']}: {t['note']}" for t in tests["tests"] if t["outcome"] == "failed"]
    if not tests["tests"]:
        failures.append("tests: no results in junit.xml")
    missed = [f"{o['model']} {o['precision']}: engine {o['overhead']:+.1%} vs the plain loop" for o in overhead
              if not o["within_target"]]
    ok = not failures

    gpus = env.get("gpus") or []
    lines = [
        f"# GPU check: {'passed' if ok else 'FAILED'}",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}; {time.monotonic() - started:.0f} s of a {BUDGET_S:.0f} s "
        "budget; `bash scripts/gpu_check.sh` (scripts/gpu_check.py)",
        "",
        f"- GPU: {', '.join(gpus) or '?'} ({len(gpus)} visible, {env.get('gpu_memory_gib', '?')} GiB, "
        f"{env.get('capability', '?')}); nvidia-smi: {smi}",
        f"- torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, cuDNN {env.get('cudnn', '?')}, "
        f"NCCL {env.get('nccl', '?')}, Python {env.get('python', '?')}",
        "",
        "## Steps",
        "",
        "| step | result | seconds | log |",
        "|---|---|---|---|",
        *[f"| {s.key} | {s.status} | {s.seconds:.1f} | {s.log} |" for s in steps],
        "",
        f"## Tests (tests/test_gpu.py): {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped",
        "",
        "| test | result | seconds | note |",
        "|---|---|---|---|",
        *[f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {t['note'].replace('|', '/')} |"
          for t in tests["tests"]],
        "",
        "## Engine step time vs a plain loop (scripts/bench_overhead.py; "
        f"target: at most {OVERHEAD_TARGET:.0%} slower)",
        "",
        "| model | precision | plain ms/step | engine ms/step | engine vs plain | within target |",
        "|---|---|---|---|---|---|",
        *[f"| {o['model']} | {o['precision']} | {o['plain_ms']:.1f} | {o['engine_ms']:.1f} | {o['overhead']:+.1%} | "
          f"{'yes' if o['within_target'] else 'NO'} |" for o in overhead],
    ]
    if not overhead:
        lines.append("(no results: see the overhead steps' logs)")
    lines += ["", "## Peak memory: engine vs plain loop (ResNet-50, bf16, batch 32, AdamW)", ""]
    if memory:
        p = memory["param_bytes"]
        lines += [
            "| | plain loop | engine | engine - plain | (engine - plain) / parameter bytes |",
            "|---|---|---|---|---|",
            f"| peak | {mib(memory['plain_peak'])} | {mib(memory['engine_peak'])} | {mib(memory['extra_peak'])} | "
            f"{memory['extra_peak_over_param_bytes']:.2f} |",
            f"| after a step | {mib(memory['plain_after_step'])} | {mib(memory['engine_after_step'])} | "
            f"{mib(memory['extra_after_step'])} | {memory['extra_after_step_over_param_bytes']:.2f} |",
            "",
            f"Parameter bytes {mib(p)}; the engine's buckets {mib(memory['bucket_bytes'])} (the parameters are views "
            "of them) plus a `comm` buffer of the same size. Bound checked: engine - plain <= 1.5 x parameter bytes "
            "+ 64 MiB.",
        ]
    else:
        lines.append("(no measurement: see the tests' log)")
    lines += ["", "## Measurements printed by the tests", ""]
    lines += [f"- `{json.dumps(m, separators=(',', ':'))}`" for m in measurements] or ["(none)"]
    lines += ["", "## Failures", ""] + ([f"- {f}" for f in failures] or ["none"])
    lines += ["", "## Targets missed (reported, not failures)", ""] + ([f"- {m}" for m in missed] or ["none"])
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({
        "passed": ok, "env": env, "nvidia_smi": smi, "budget_s": BUDGET_S,
        "steps": [dict(key=s.key, status=s.status, seconds=round(s.seconds, 1), command=s.command) for s in steps],
        "tests": tests, "overhead": overhead, "overhead_target": OVERHEAD_TARGET, "memory": memory,
        "measurements": measurements, "failures": failures, "targets_missed": missed,
    }, indent=2, default=str) + "\n")
    return ok, text


def skip_mode(out: Path, steps: list[Step], env: dict[str, Any]) -> int:
    print("no CUDA GPU: skip mode")
    print(f"torch {env.get('torch', '?')} sees no CUDA device; on a CUDA GPU this would run, within {BUDGET_S:.0f} s:")
    planned = [f"{i}. [{s.key}] {s.what}\n     $ {s.command}"
               for i, s in enumerate(steps, 1)]
    planned.append(f"{len(steps) + 1}. {SUMMARY_STEP}")
    for line in planned:
        print(line)
    print("\nThe GPU tests, skipped here with their reason:", flush=True)
    argv = [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
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
    deadline = started + BUDGET_S
    out = Path(argv[0] if argv else "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("junit.xml", "measurements.jsonl", "overhead_bf16.json", "overhead_fp16.json", "summary.json"):
        (out / stale).unlink(missing_ok=True)
    steps = plan(out)

    probe_start = time.monotonic()
    try:
        probe = subprocess.run([PY, "-c", ENV_PROBE], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                               timeout=120)
        env, problem = parse_env(probe.stdout), probe.stdout + probe.stderr
    except subprocess.TimeoutExpired:
        env, problem = {}, "python -c 'import torch; torch.cuda...' took over 120 s"
    probe_seconds = time.monotonic() - probe_start
    if not env:
        print(f"gpu_check: torch does not import or answer:\n{problem}", file=sys.stderr)
        (out / "summary.md").write_text(
            f"# GPU check: FAILED\n\ntorch does not import or answer:\n\n```\n{problem}\n```\n")
        return 1
    if not env["cuda_available"]:
        return skip_mode(out, steps, env)

    smi = nvidia_smi()
    print(f"CUDA GPU: {', '.join(env['gpus'])}; nvidia-smi: {smi}")
    print(f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, NCCL {env['nccl']}; "
          f"budget {BUDGET_S:.0f} s")
    print(f"out: {out}", flush=True)
    env_step = steps[0]  # the probe above was this step: its output is the log
    env_step.status, env_step.seconds, env_step.log = "ok", probe_seconds, "env.log"
    (out / "env.log").write_text(f"{json.dumps(env, indent=2)}\n\n{nvidia_smi(full=True)}\n")

    def stop(signum: int, frame: Any) -> None:  # stopped from outside: still write what was measured
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        for step in steps[1:]:
            run_step(step, out, deadline)
    except KeyboardInterrupt as stopped:
        print(f"\ngpu_check: stopped ({stopped or 'interrupt'}); writing the summary of what ran", flush=True)
    ok, text = write_summary(out, steps, env, smi, started)
    print(f"\n=== [summary] {out / 'summary.md'}\n\n{text}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
