#!/usr/bin/env bash
# The wheels decent_train needs on the GPU machine beyond what its image holds, into .whl/ (ignored by .gitignore):
#
#   bash scripts/gpu_wheels.sh            # run here, where pip reaches PyPI; then carry .whl to the GPU machine
#
# The GPU machine (Python 3.12, torch 2.11 with CUDA 13, x86-64, no network) has torch, torchvision, numpy,
# scikit-learn, matplotlib, tqdm, PyYAML, packaging, pytest and pillow, but not hydra-core, omegaconf (with its parser
# runtime antlr4-python3-runtime), loguru or setproctitle: /work/.library/device/KINDS.md lists its packages. wandb
# is imported only by logger=wandb runs, decent-dp and torchft only by CPU tests, so none of them travels. The
# versions are the ones this checkout is tested with (pyproject.toml's ranges). All are pure Python but setproctitle
# (its cp312 manylinux wheel); antlr4-python3-runtime 4.9.3 is published as a source archive only, so pip builds its
# wheel here. The header of scripts/gpu_check.sh has the device command that installs them (pip install --target) and
# runs the check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=.whl
# name==version, one version each: two versions of one package stop the install on the GPU machine
BINARY=(hydra-core==1.3.8 omegaconf==2.3.1 loguru==0.7.3 setproctitle==1.3.8)
FROM_SOURCE=(antlr4-python3-runtime==4.9.3)

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${BINARY[@]}"
"$PYTHON" -m pip wheel -q --no-deps --no-binary=:all: -w "$WHEELS" "${FROM_SOURCE[@]}"

# Each wheel pure Python (py3-none-any), and what each requires present (in .whl or on the GPU machine):
for wheel in "$WHEELS"/*.whl; do
    case "$(basename "$wheel")" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-*manylinux*x86_64*.whl) ;;
        *) echo "gpu_wheels: $(basename "$wheel") is not pure Python: check it matches cp312 manylinux x86-64" >&2 ;;
    esac
    echo "$(basename "$wheel"): $(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
        | sed 's/Requires-Dist: //' | tr '\n' ';')"
done
count=$(ls "$WHEELS"/*.whl | wc -l)
size=$(du -sk "$WHEELS" | cut -f1)
echo "gpu_wheels: $count wheels, ${size} KiB in $WHEELS/ (the working tree that travels may hold 64 MiB)"
if [ "$count" -ne $((${#BINARY[@]} + ${#FROM_SOURCE[@]})) ] || [ "$size" -gt 16384 ]; then
    echo "gpu_wheels: expected $((${#BINARY[@]} + ${#FROM_SOURCE[@]})) wheels under 16 MiB" >&2
    exit 1
fi
