#!/usr/bin/env bash
# The main job: builds the demo against the distribution's LibTorch and runs it - DP x SP data
# iteration on 4 local processes, BASE (every rank loads) vs dedup (only SP leaders load),
# with batch checksums, step times, CPU PSS and a restart check. Arguments go to the demo
# (try --help); results land in ./demo-out. It installs only what the demo needs
# (scripts/setup.sh demo) and builds only the demo, in a tree of its own (build/demo; without
# the precompiled LibTorch headers, which would cost the two files' parallel compile a serial one).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/environments.sh
./scripts/setup.sh demo  # installs what is missing; seconds when everything is there
SECONDS=0
torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")"
echo "demo: building spbcast_demo against $torch_dir (build/demo, build-demo.log)"
export CCACHE_BASEDIR="$PWD"
{ cmake -S . -B build/demo -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
        -DSPBCAST_BUILD_TESTS=OFF -DSPBCAST_BUILD_BENCH=OFF -DSPBCAST_PRECOMPILE_TORCH=OFF \
        -DSPBCAST_PYTHON="$(environment_dir demo)/bin/python" &&
  cmake --build build/demo -j"${SPBCAST_JOBS:-2}" --target spbcast_demo; } > build-demo.log 2>&1 \
    || { cat build-demo.log; exit 1; }
echo "demo: built in $SECONDS s"
exec ./build/demo/examples/spbcast_demo "$@"
