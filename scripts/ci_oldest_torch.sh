#!/usr/bin/env bash
# CI's second job: the inner-loop tests (pytest -m "not slow") on the oldest torch that pyproject.toml admits.
#
# Creates a virtual environment in a temporary folder (removed at the end), installs torch and torchvision at the
# floor's versions, then the package with its test extras under a constraint that keeps them there (pip would
# otherwise upgrade to the newest it may), and runs the tests from the repository root. Set OLDEST_TORCH_VENV to a
# folder to keep the environment there and reuse it on the next run; with --install-only it stops before the tests
# (.ci/run installs while the main suite runs). Exit status: pytest's (5, no tests, reads 0).
set -uo pipefail
cd "$(dirname "$0")/.."

# "===": exactly this version, the build that PyPI ships (CUDA 12.8; the tests here run on the CPU). "==" would also
# admit a local build such as 2.10.0+cpu from a find-links folder, which ranks higher, but torchvision 0.25.0 is built
# against PyPI's build: its requirement, torch==2.10.0, admits the local one too, and its operators fail to load
# against another build (seen with 2.13.0+cpu and torchvision 0.28.0).
TORCH_VERSION=2.10.0        # pyproject.toml: torch>=2.10
TORCHVISION_VERSION=0.25.0  # pyproject.toml: torchvision>=0.25

start=$(date +%s)
if [ -n "${OLDEST_TORCH_VENV:-}" ]; then
  venv=$OLDEST_TORCH_VENV
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  venv=$tmp/venv
fi
constraints=$(dirname "$venv")/oldest-torch-constraints.txt
mkdir -p "$(dirname "$venv")"
printf 'torch===%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$constraints"

if [ ! -x "$venv/bin/python" ]; then
  python -m venv "$venv" || exit 1
fi
py=$venv/bin/python
"$py" -m pip install -q "torch===$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" || exit 1
"$py" -m pip install -q -c "$constraints" -e ".[test]" || exit 1
"$py" -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
installed=$(date +%s)
if [ "${1:-}" = "--install-only" ]; then
  echo "oldest torch: installed in $((installed - start)) s"
  exit 0
fi

"$py" -m pytest -q -n 2 --dist loadfile -m "not slow"
code=$?
echo "oldest torch: install $((installed - start)) s, tests $(($(date +%s) - installed)) s, pytest exit $code"
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests (exit 5)"
  exit 0
fi
exit "$code"
