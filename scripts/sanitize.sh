#!/usr/bin/env bash
# Builds the whole test suite with AddressSanitizer and UndefinedBehaviorSanitizer against the
# distribution's LibTorch (tree build/asan, g++) and runs it with ctest. LibTorch itself is not
# instrumented; its allocations still go through ASan's allocator, so a view that reaches past
# a storage spbcast allocated, or a use after free of one, is reported.
#
#   ./scripts/sanitize.sh                 build and run the test programs
#   ./scripts/sanitize.sh -R faults       extra arguments go to ctest
#   ./scripts/sanitize.sh --build         only configure and build
#
# What runs: every ctest that executes spbcast code - spbcast_tests and the fault suites
# (tests/faults) - with their worker programs. Not run here: the compile-only checks
# (compile_fail.*, find_package_consumer, header_provenance: nothing sanitized executes), the
# netns test (it needs root and starts the plain build's worker; run scripts/netns_test.sh
# with build/asan/tests/faults/spbcast_fault_worker to sanitize it too), and the demo and
# benchmark quick runs (SPBCAST_SANITIZE_ALL=1 builds and runs everything).
#
# Runtime options (override by exporting your own):
#   ASAN_OPTIONS   detect_leaks=1 (LeakSanitizer on; no suppressions were needed: LibTorch's
#                  and Gloo's process-lifetime objects stay reachable, and so does spbcast's
#                  quarantine of buffers of failed broadcasts, collective.hpp), abort_on_error=1
#                  so a report fails the test that triggered it, detect_stack_use_after_return=0
#                  (LibTorch is not instrumented; fake stacks only cost time here).
#   UBSAN_OPTIONS  print_stacktrace=1, halt_on_error=1.
#   SPBCAST_SOAK_STEPS  200 (sanitized code is several times slower; the plain build runs 1000).
set -euo pipefail
cd "$(dirname "$0")/.."

JOBS="${SPBCAST_JOBS:-2}"
torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")"
[ -d "$torch_dir" ] || { echo "sanitize: the distribution's LibTorch (libtorch-dev) is not installed"; exit 1; }
# vptr off: it needs the typeinfo of LibTorch classes, which LibTorch does not export for all
# of them (c10::DynamicType), so a test touching such a type would not link.
# -O0 -g1: UndefinedBehaviorSanitizer's checks in LibTorch's inline code make optimizing them
# most of the compile time, and line tables are all a report needs.
# The 40-step restart in new processes (the slowest case at ASan speed) repeats code the other
# loader cases run in one process: the Release trees run it.
asan_test_args="--test-case-exclude=restart:*"
flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1 -O0"

echo "=== spbcast: ASan + UBSan build (build/asan, LibTorch from $torch_dir)"
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="" -DTorch_DIR="$torch_dir" \
      -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
      -DSPBCAST_BUILD_EXAMPLES=OFF -DSPBCAST_BUILD_BENCH=OFF -DSPBCAST_BUILD_TESTS=ON \
      -DSPBCAST_TESTS_ARGS="$asan_test_args" \
      > build-asan.configure.log 2>&1 || { cat build-asan.configure.log; exit 1; }
if [ -n "${SPBCAST_SANITIZE_ALL:-}" ]; then
    cmake --build build/asan -j"$JOBS"
    selection=(-E 'netns')
else
    cmake --build build/asan -j"$JOBS" --target spbcast_tests spbcast_fault_tests
    selection=(-R '^(spbcast_tests|spbcast_faults_)' -E 'netns')
fi
[ "${1:-}" != --build ] || exit 0

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export SPBCAST_SOAK_STEPS="${SPBCAST_SOAK_STEPS:-200}"
echo "=== ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS SPBCAST_SOAK_STEPS=$SPBCAST_SOAK_STEPS"
# Two suites at a time: one rarely keeps both cores busy; those that time how soon a rank
# raises run alone (RUN_SERIAL).
(cd build/asan && ctest --output-on-failure --timeout 1800 -j"$JOBS" "${selection[@]}" "$@")
