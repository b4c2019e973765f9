#!/usr/bin/env bash
# Builds spbcast's tests, examples and benchmarks against both LibTorch generations - the
# distribution's libtorch-dev and the PyTorch 2.13 wheel - and runs every test (ctest) for each;
# then builds the Python package into the wheel's environment and runs its tests (pytest), again
# on the reference PR's PyTorch 2.9.1, and the drop-ins whose trainers need environments of their
# own (ms-swift's). Each environment is made only when a generation that needs it runs; the slow
# ones fill in the background while the trees build.
#   ./scripts/test.sh              everything below
#   ./scripts/test.sh system       only the distribution's LibTorch
#   ./scripts/test.sh wheel        only the wheel
#   ./scripts/test.sh python       only the Python package (PyTorch 2.13)
#   ./scripts/test.sh python-2.9   only the Python package on PyTorch 2.9.1 (the tests of what
#                                  differs between torch releases)
#   ./scripts/test.sh python-swift only spbcast.swift against ms-swift (its own environment)
#   ./scripts/test.sh python-verl  only spbcast.verl against verl (its own environment)
#   ./scripts/test.sh --build GEN  only configure and build GEN's tree (system or wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/environments.sh

VENV="$(environment_dir main)"
REFERENCE_VENV="$(environment_dir reference)"
# Lets ccache reuse objects between clones in different folders (CI builds a fresh clone).
export CCACHE_BASEDIR="$PWD"
JOBS="${SPBCAST_JOBS:-2}"
# Each step's line says how long the run has taken so far (.ci/run passes its own start on).
STEP_LABEL=spbcast
source scripts/step.sh

build() {
    local torch_dir
    case "$1" in
        system) torch_dir="$(dirname "$(find /usr/lib -path '*cmake/Torch/TorchConfig.cmake' | head -1)")" ;;
        wheel) torch_dir="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "share/cmake/Torch"))')" ;;
        *) echo "unknown generation '$1' (system, wheel, python)"; exit 2 ;;
    esac
    step "building the $1 generation against LibTorch in $torch_dir"
    cmake -S . -B "build/$1" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
          -DSPBCAST_PYTHON="$VENV/bin/python" > "build-$1.configure.log" 2>&1 \
        || { cat "build-$1.configure.log"; exit 1; }
    grep "spbcast:" "build-$1.configure.log"
    cmake --build "build/$1" -j"$JOBS"
}
if [ "${1:-}" = "--build" ]; then
    build "$2"
    exit
fi

# Installs what is missing (seconds when everything is there); the Python package is built below,
# while a tree builds, by the python generation.
./scripts/setup.sh --no-python-package main
generations=("${@:-system wheel python python-2.9 python-swift python-verl}")
generations=(${generations[*]})

# The environments of the later generations fill while the trees build, at a low priority, one
# after the other; each suite asks for its own first (scripts/setup.sh NAME: it waits while the
# background is making it, and is seconds once it is there).
later_environments=()
for gen in "${generations[@]}"; do
    case "$gen" in
        python-2.9) later_environments+=(reference) ;;
        python-swift) later_environments+=(swift) ;;
        python-verl) later_environments+=(verl) ;;
    esac
done
environments_setup=""
if [ ${#later_environments[@]} -gt 0 ]; then
    set -m
    nice -n 10 ./scripts/setup.sh "${later_environments[@]}" > build-environments.setup.log 2>&1 &
    environments_setup=$!
    set +m
fi
# ensure_environment NAME: the environment, made now if the background has not made it yet.
ensure_environment() {
    ./scripts/setup.sh "$1" > "build-$1.setup.log" 2>&1 \
        || { grep -v "^WARNING: Location" "build-$1.setup.log"; exit 1; }
}

# While one generation's tests run, the next generation's tree builds at the lowest nice level:
# it takes the CPU that the tests leave free - they mostly wait on sockets, processes and
# timeouts - and next to nothing while they compute, so it cannot slow a timed test. Its output
# goes to build-<gen>.log.
# What differs between torch releases, within CI's budget: the XTuner switch on XTuner's real
# pipeline (the media one) and Trainer (DeviceMesh, the accelerator API, DataLoader workers), the
# loader's failures, patience and prefetch (group timeouts and names, the generator's state,
# threads and fork), resume (the DataLoader's persistent iterator), jagged nested tensors (torch's
# private nested-tensor internals, python/spbcast/_wire/torch_nested.py) and the extension built
# against this torch. The environment holds no XTuner (nor numpy): XTuner's tests run in its
# overlay (scripts/setup.sh), where there is one.
run_reference_suite() {
    step "Python package on PyTorch 2.9.1 ($REFERENCE_VENV)"
    "$REFERENCE_VENV/bin/python" -m pytest -q python/tests/test_loader_errors.py \
        python/tests/test_global_ranks.py python/tests/test_prefetch.py python/tests/test_resume_matrix.py \
        python/tests/test_nested.py
    run_xtuner_tests "$REFERENCE_VENV" -k "not text_pipeline"
}
# XTuner v1's tests, in the XTuner overlay of an environment; a note where there is none.
run_xtuner_tests() {
    local overlay="$1-xtuner"
    shift
    if [ -x "$overlay/bin/python" ]; then
        step "XTuner v1's tests in its overlay ($overlay)"
        "$overlay/bin/python" -m pytest -q python/tests/test_xtuner.py python/tests/test_xtuner_trainer.py "$@"
    else
        step "no XTuner v1 overlay ($overlay): XTuner's tests skipped (scripts/setup.sh installs it from ../shared/wheels/xtuner-*.whl or \$SPBCAST_XTUNER_WHEEL)"
    fi
}

# --- the drop-ins whose trainers need environments of their own: ms-swift's (spbcast.swift) and
# verl's (spbcast.verl). run_trainer_suite ENVIRONMENT TRAINER TEST ---------------------------------
run_trainer_suite() {
    local dir
    dir="$(environment_dir "$1")"
    step "spbcast.$1 against $2 ($dir)"
    ensure_environment "$1"
    "$dir/bin/python" -m pytest -q "$3"
}
# -------------------------------------------------------------------------------------------------

# The suites of the Python generations that run in environments of their own.
run_side_suite() {
    case "$1" in
        python-2.9) ensure_environment reference
                    run_reference_suite ;;
        python-swift) run_trainer_suite swift ms-swift python/tests/test_swift.py ;;
        python-verl) run_trainer_suite verl verl python/tests/test_verl.py ;;
    esac
}
# With the python generation, these run one after the other beside its suite: their ranks, like
# its, mostly wait on sockets, processes and timeouts (every distributed test waits for all its
# ranks to set up before it starts, and bounds its waits generously). Each one's output goes to
# build-<gen>.test.log and its exit status to build-<gen>.test.status, printed and checked when
# the loop reaches it.
side_generations=()
if [[ " ${generations[*]} " == *" python "* ]]; then
    for gen in "${generations[@]}"; do
        case "$gen" in python-*) side_generations+=("$gen") ;; esac
    done
fi
rm -f build-python-*.test.status
run_side_suites() {
    local gen status
    for gen in "${side_generations[@]}"; do
        # A subshell of its own, outside any condition, so that errexit holds in the suite.
        set +e
        (set -e; run_side_suite "$gen") > "build-$gen.test.log" 2>&1
        status=$?
        set -e
        echo "$status" > "build-$gen.test.status"
    done
}

background=""
side_suites=""
trap '[ -z "$background" ] || kill -- "-${background##*:}" 2>/dev/null || true
      [ -z "$environments_setup" ] || kill -- "-$environments_setup" 2>/dev/null || true
      [ -z "$side_suites" ] || kill -- "-$side_suites" 2>/dev/null || true' EXIT
for i in "${!generations[@]}"; do
    gen="${generations[$i]}"
    if [ "${background%%:*}" = "$gen" ]; then
        step "waiting for the $gen build (build-$gen.log)"
        wait "${background##*:}" || { cat "build-$gen.log"; exit 1; }
        background=""
        grep "spbcast:" "build-$gen.log" || true
    elif [[ "$gen" != python* ]]; then
        build "$gen"  # refuses an unknown generation
    fi
    next="${generations[$((i + 1))]:-}"
    if [ "$next" = python ]; then
        # The Python package compiles its extension the same way, while the last tree's tests run.
        set -m
        SPBCAST_VENV="$VENV" nice -n 19 ./scripts/python_package.sh > build-python.log 2>&1 &
        background="python:$!"
        set +m
    elif [ "$next" = system ] || [ "$next" = wheel ]; then
        # Job control gives it a process group of its own (to stop it if a test fails) but keeps
        # it in this session: a new session would get a scheduler autogroup of its own, which
        # the kernel shares the CPU with as an equal whatever the nice level inside it.
        set -m
        nice -n 19 ./scripts/test.sh --build "$next" > "build-$next.log" 2>&1 &
        background="$next:$!"
        set +m
    fi
    if [ "$gen" = python ]; then
        step "Python package ($VENV)"
        SPBCAST_VENV="$VENV" ./scripts/python_package.sh
        if [ ${#side_generations[@]} -gt 0 ]; then
            set -m
            run_side_suites &
            side_suites=$!
            set +m
        fi
        # From the repository root, so that `import spbcast` finds the installed package.
        SPBCAST_REFERENCE_VENV="$REFERENCE_VENV" "$VENV/bin/python" -m pytest -q --durations=15 python/tests
        run_xtuner_tests "$VENV"
    elif [[ " ${side_generations[*]} " == *" $gen "* ]]; then
        step "waiting for $gen's tests (build-$gen.test.log)"
        while [ ! -f "build-$gen.test.status" ] && kill -0 "$side_suites" 2>/dev/null; do sleep 1; done
        cat "build-$gen.test.log"
        status="$(cat "build-$gen.test.status" 2>/dev/null || echo 1)"
        [ "$status" = 0 ] || exit "$status"
    elif [[ "$gen" == python-* ]]; then
        run_side_suite "$gen"
    else
        # What does not depend on the LibTorch a tree links (spbcast's own static_asserts, the
        # docs' links, the layering of the headers) runs in the first tree only.
        skip=()
        if [ "$gen" != "${generations[0]}" ]; then skip=(-E '^(compile_fail\.|docs_links$|layers$)'); fi
        step "the $gen generation's tests (ctest in build/$gen)"
        (cd "build/$gen" && ctest --output-on-failure --timeout 900 "${skip[@]}")
    fi
done
step "every test passed"
