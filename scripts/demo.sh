#!/usr/bin/env bash
# The main job: builds the demo against the distribution's LibTorch and runs it - DP x SP data
# iteration on 4 local processes, BASE (every rank loads) vs dedup (only SP leaders load),
# with batch checksums, step times, CPU PSS and a restart check. Arguments go to the demo
# (try --help); results land in ./demo-out.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh  # installs what is missing; seconds when everything is there
VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")"
cmake -S . -B build/system -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
      -DSPBCAST_PYTHON="$VENV/bin/python" > build-system.configure.log 2>&1 \
    || { cat build-system.configure.log; exit 1; }
cmake --build build/system -j"${SPBCAST_JOBS:-2}" --target spbcast_demo
exec ./build/system/examples/spbcast_demo "$@"
