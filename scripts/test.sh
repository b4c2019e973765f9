#!/usr/bin/env bash
# Builds spbcast's tests, examples and benchmarks against both LibTorch generations - the
# distribution's libtorch-dev and the PyTorch 2.13 wheel - and runs every test (ctest) for each;
# then builds the Python package into the wheel's environment and runs its tests (pytest).
#   ./scripts/test.sh              both generations and the Python package
#   ./scripts/test.sh system       only the distribution's LibTorch
#   ./scripts/test.sh wheel        only the wheel
#   ./scripts/test.sh python       only the Python package
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh  # installs what is missing; seconds when everything is there

VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
# Lets ccache reuse objects between clones in different folders (CI builds a fresh clone).
export CCACHE_BASEDIR="$PWD"
JOBS="${SPBCAST_JOBS:-2}"
generations=("${@:-system wheel python}")
generations=(${generations[*]})

for gen in "${generations[@]}"; do
    case "$gen" in
        system) torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")" ;;
        python)
            echo "=== spbcast: Python package ($VENV)"
            SPBCAST_VENV="$VENV" ./scripts/python_package.sh
            # From the repository root, so that `import spbcast` finds the installed package.
            "$VENV/bin/python" -m pytest -q python/tests
            continue ;;
        wheel) torch_dir="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "share/cmake/Torch"))')" ;;
        *) echo "unknown generation '$gen' (system, wheel, python)"; exit 2 ;;
    esac
    echo "=== spbcast: $gen LibTorch ($torch_dir)"
    cmake -S . -B "build/$gen" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
          -DSPBCAST_PYTHON="$VENV/bin/python" > "build-$gen.configure.log" 2>&1 \
        || { cat "build-$gen.configure.log"; exit 1; }
    grep "spbcast:" "build-$gen.configure.log"
    cmake --build "build/$gen" -j"$JOBS"
    (cd "build/$gen" && ctest --output-on-failure --timeout 900)
done
