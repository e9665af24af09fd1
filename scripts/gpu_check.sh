#!/usr/bin/env bash
# One command that says whether decent-train works on a GPU: it exits 0 only if everything passed, in at most 8
# minutes on one H100 (GPU_CHECK_BUDGET_S, default 470 s), and writes OUT_DIR/summary.md and summary.json (GPU,
# driver, torch, CUDA, NCCL versions, every number, what failed), measurements.jsonl and gpu_check.log (the console):
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # default: gpu_check_out/ (run from anywhere)
#
# With a CUDA GPU, in order (scripts/gpu_check.py has the steps and the decisions):
#   [overhead-b256], [overhead-b64]  scripts/bench_overhead.py: engine vs a plain loop, GPT-2 small 8 x 1024 and
#                                    ResNet-50 channels_last at batch 256 and 64, bf16; FAILS above 1.10x, reports
#                                    the targets (1.03, 1.03, 1.05)
#   [offload]  scripts/bench_offload.py: Streaming DiLoCo's outer state on the device and offloaded (reported)
#   [cli-job]  the default job, `python -m decent_train.launcher.cli launch=gpu`: finite losses, accuracy >= 0.95
#   [tests]    python -m pytest -m gpu tests/: every gpu-marked test, the fronts (DiLoCo, Streaming DiLoCo with int8
#              on Triton, LocalSGD, FSDP2 + gossip) against their CPU replays, and 2-4 processes sharing the GPU
#              (NCCL with a distinct NCCL_HOSTID per rank, or gloo with CUDA tensors if NCCL refuses: recorded)
# Without one: prints "no CUDA GPU: skip mode" and the plan, shows the GPU tests skipping, exits 0.
#
# On the workplace's GPU machine (python3 3.12, torch 2.11, no network, no hydra-core/omegaconf/loguru), first here:
# `bash scripts/gpu_wheels.sh` (fills .whl/, 500 KiB), then the device tool's `run` with carry [".whl"],
# timeout_s 600 and this command (outputs: $OUT/gpu/, 4 files, one folder down):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; nvidia-smi -L; bash scripts/gpu_check.sh $OUT/gpu
#
# It installs nothing else. PYTHON picks the interpreter (default: the first of python3, python that imports torch);
# the repository root goes first on PYTHONPATH so that workers started by the launcher import this checkout. If
# decent_train still does not import, it tries `pip install -e .` (where pip reaches an index).
set -uo pipefail

CALLER_DIR="$PWD"
OUT_DIR="${1:-gpu_check_out}"
case "$OUT_DIR" in /*) ;; *) OUT_DIR="$CALLER_DIR/$OUT_DIR" ;; esac  # relative to where it was called from
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO="$PWD"
if [ -z "${PYTHON:-}" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null && "$candidate" -c 'import torch' >/dev/null 2>&1; then
            PYTHON="$(command -v "$candidate")"
            break
        fi
    done
fi
if [ -z "${PYTHON:-}" ]; then
    echo "gpu_check: no python on PATH imports torch" >&2
    exit 1
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c 'import decent_train.launcher.job' >/dev/null 2>&1; then
    echo "gpu_check: decent_train does not import; pip install -e ."
    if ! "$PYTHON" -m pip install -e .; then
        echo "gpu_check: pip install -e . failed; decent_train does not import (on a machine without an index, carry" \
            "the wheels of scripts/gpu_wheels.sh):" >&2
        "$PYTHON" -c 'import decent_train.launcher.job' >&2
        exit 1
    fi
fi

mkdir -p "$OUT_DIR" || exit 1
"$PYTHON" scripts/gpu_check.py "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gpu_check.log"
