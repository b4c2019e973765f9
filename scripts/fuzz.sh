#!/usr/bin/env bash
# Fuzzes a follower's frame decoding (fuzz/fuzz_frames.cpp: parse_frame, payload fill,
# decode_value, for xtuner::Batch and c10::IValue) with libFuzzer + ASan + UBSan, for a bounded
# time, starting from a seed corpus of valid frames recorded from real broadcasts.
#
#   ./scripts/fuzz.sh [seconds]          default 120 (SPBCAST_FUZZ_SECONDS)
#   ./scripts/fuzz.sh --build            only configure and build the fuzz target
#
# Tree build/fuzz (clang++, the PyTorch wheel's LibTorch by default, see below). The corpus grows in
# build/fuzz/corpus across runs; findings land in build/fuzz/artifacts/ and the script fails.
# Reproduce one with: build/fuzz/fuzz/spbcast_fuzz_frames build/fuzz/artifacts/crash-...
# Allocation bound: the target decodes with small limits (fuzz/fuzz_common.hpp: 16 MiB of
# payload, 1 MiB of frame); -malloc_limit_mb=64 turns any single larger allocation into a
# finding, -rss_limit_mb=2048 any runaway total.
# Needs clang and its runtime: Debian packages clang-14 and libclang-rt-14-dev.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${SPBCAST_FUZZ_SECONDS:-120}}"
JOBS="${SPBCAST_JOBS:-2}"
CXX_FUZZ="${SPBCAST_FUZZ_CXX:-clang++}"
command -v "$CXX_FUZZ" > /dev/null || { echo "fuzz: $CXX_FUZZ not found (Debian: clang-14)"; exit 1; }
probe="$(mktemp -d)"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$probe/p.cpp"
if ! "$CXX_FUZZ" -fsanitize=fuzzer,address "$probe/p.cpp" -o "$probe/p" 2> "$probe/err"; then
    echo "fuzz: $CXX_FUZZ cannot link libFuzzer + ASan: $(tail -1 "$probe/err")"
    echo "fuzz: install the runtime: apt-get install libclang-rt-14-dev"
    rm -rf "$probe"; exit 1
fi
rm -rf "$probe"

# The LibTorch to decode with. Default: the PyTorch wheel (scripts/setup.sh installs it), because
# clang 14 cannot compile LibTorch 1.13's headers in C++20 (ATen/core/List.h instantiates
# std::vector<c10::IValue> while IValue is incomplete; g++ accepts it). SPBCAST_FUZZ_TORCH=system
# picks the distribution's LibTorch (for a newer clang).
VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
case "${SPBCAST_FUZZ_TORCH:-wheel}" in
    wheel) torch_dir="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "share/cmake/Torch"))')" ;;
    system) torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")" ;;
    *) echo "fuzz: SPBCAST_FUZZ_TORCH must be wheel or system"; exit 2 ;;
esac
echo "=== spbcast fuzz: $CXX_FUZZ, LibTorch from $torch_dir"
cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER="$CXX_FUZZ" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTorch_DIR="$torch_dir" -DSPBCAST_BUILD_FUZZ=ON -DSPBCAST_BUILD_TESTS=OFF \
      -DSPBCAST_BUILD_EXAMPLES=OFF -DSPBCAST_BUILD_BENCH=OFF > build-fuzz.configure.log 2>&1 \
    || { cat build-fuzz.configure.log; exit 1; }
cmake --build build/fuzz -j"$JOBS" --target spbcast_fuzz_frames spbcast_fuzz_seeds
[ "$seconds" != --build ] || exit 0

mkdir -p build/fuzz/corpus build/fuzz/artifacts
rm -rf build/fuzz/seeds
build/fuzz/fuzz/spbcast_fuzz_seeds build/fuzz/seeds

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
echo "=== fuzzing for $seconds s"
set +e
build/fuzz/fuzz/spbcast_fuzz_frames build/fuzz/corpus build/fuzz/seeds \
    -max_total_time="$seconds" -max_len=65536 -timeout=30 \
    -malloc_limit_mb=64 -rss_limit_mb=2048 \
    -artifact_prefix=build/fuzz/artifacts/ -print_final_stats=1 > build/fuzz/last-run.log 2>&1
status=$?
set -e
grep -v -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)' build/fuzz/last-run.log | tail -n 60
if [ "$status" != 0 ]; then
    echo "fuzz: FOUND A PROBLEM (exit $status); see build/fuzz/last-run.log and build/fuzz/artifacts/"
    exit 1
fi
echo "fuzz: no findings in $seconds s ($(ls build/fuzz/corpus | wc -l) inputs in the corpus)"
