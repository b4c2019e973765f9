#!/usr/bin/env bash
# Fuzzes a follower's Python decoder (python/tests/fuzz_decoder.py: hypothesis, property-based)
# for a bounded time: real envelopes mutated, truncated and spliced must decode or raise
# spbcast.Error, within a capped address space. The C++ frames are fuzzed by scripts/fuzz.sh.
#
#   ./scripts/fuzz_python.sh [seconds]    default 60 (SPBCAST_FUZZ_PYTHON_SECONDS)
#
# A finding prints hypothesis's falsifying (shrunk) tree and fails the script; keep it as a case
# in python/tests/test_decoder.py. Needs the Python package (scripts/python_package.sh installs
# it and hypothesis).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${SPBCAST_FUZZ_PYTHON_SECONDS:-60}}"
VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
./scripts/python_package.sh
echo "=== fuzzing the Python decoder for $seconds s"
"$VENV/bin/python" python/tests/fuzz_decoder.py "$seconds"
