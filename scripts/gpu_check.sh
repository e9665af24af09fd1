#!/usr/bin/env bash
# Everything worth running on one GPU, in one invocation of under 10 minutes, and one summary file:
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default: gpu_check_out/ (run from anywhere; it works in the repo root)
#
# With a CUDA GPU: the GPU tests (python -m pytest -q -m gpu -s tests/test_gpu.py: the engine at world size 1 vs the
# replay, bf16 and fp16 + GradScaler, channels_last and torch.compile on ResNet-18 and GPT-2, peak memory vs a plain
# loop, NCCL with 2 processes if there are 2 GPUs), then scripts/bench_overhead.py (engine step time vs a plain loop,
# ResNet-50 and GPT-2 small in bf16, ResNet-50 in fp16), then OUT_DIR/summary.md and summary.json. A failing step is
# recorded and the rest still run; the exit status is 1 if anything failed. Logs: OUT_DIR/<step>.log, junit.xml,
# measurements.jsonl, overhead_*.json.
#
# Without one: prints "no CUDA GPU: skip mode" and what it would run, shows the GPU tests skipping with their reason,
# writes OUT_DIR/summary.md saying so, and exits 0.
#
# It installs nothing, except `pip install -e .` when decent_train does not import. PYTHON picks the interpreter
# (default: python, else python3); GPU_CHECK_BUDGET_S the total time budget in seconds (default 540). The steps
# themselves are in scripts/gpu_check.py.
set -uo pipefail

CALLER_DIR="$PWD"
OUT_DIR="${1:-gpu_check_out}"
case "$OUT_DIR" in /*) ;; *) OUT_DIR="$CALLER_DIR/$OUT_DIR" ;; esac  # relative to where it was called from
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
if [ -z "$PYTHON" ]; then
    echo "gpu_check: no python on PATH" >&2
    exit 1
fi

if ! "$PYTHON" -c 'import decent_train' >/dev/null 2>&1; then
    echo "gpu_check: decent_train does not import; pip install -e ."
    if ! "$PYTHON" -m pip install -e .; then
        echo "gpu_check: pip install -e . failed; decent_train does not import:" >&2
        "$PYTHON" -c 'import decent_train' >&2
        exit 1
    fi
fi

"$PYTHON" scripts/gpu_check.py "$OUT_DIR"
