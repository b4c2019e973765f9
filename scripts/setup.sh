#!/usr/bin/env bash
# Installs everything spbcast needs on a fresh Debian 12 machine, by package name:
# the tool chain, Boost >= 1.81 (PFR, Hana), doctest, the distribution's LibTorch with Gloo,
# libjpeg-turbo (the demo), and two virtual environments, each with torchdata and the Python
# package built against its torch: the main one with the PyTorch 2.13.0 CPU wheel (the second
# LibTorch generation, the Python peers of the benchmarks, the drop-ins' trainers), and the
# reference one with the reference PR's PyTorch 2.9.1 (the Python package's tests on a second
# torch). Where ../shared/wheels/xtuner-*.whl or $SPBCAST_XTUNER_WHEEL provides XTuner v1, each
# environment gets an XTuner overlay beside it (<venv>-xtuner: XTuner and what it brings, over
# the environment's own packages), so that the environment itself holds only what spbcast's
# tests declare and a test that leans on something XTuner brings fails (docs/building.md).
# Idempotent: a second run checks and returns in seconds.
#   ./scripts/setup.sh                       everything
#   ./scripts/setup.sh --no-python-package   all but the Python package (.ci/run: test.sh builds
#                                            it, on one core, while the other builds a tree)
#   ./scripts/setup.sh --main-only           the packages and the main environment
#   ./scripts/setup.sh --reference-only      the packages and the reference environment (test.sh
#                                            fills it in the background while it builds)
#   ./scripts/setup.sh --swift-only          the packages and ms-swift's environment (spbcast.swift)
set -euo pipefail

python_package=yes
which=both
for option in "$@"; do
    case "$option" in
        --no-python-package) python_package=no ;;
        --main-only) which=main ;;
        --reference-only) which=reference ;;
        --swift-only) which=swift ;;
        *) echo "setup: unknown option '$option' (--no-python-package, --main-only, --reference-only, --swift-only)"; exit 2 ;;
    esac
done
MAIN_VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
TORCH_WHEEL_VERSION="2.13.0"
# The reference PR's PyTorch: PyPI's CUDA build (about 7 GB; it runs on the CPU), for the Python
# package's tests on a second torch (the switch on every torch XTuner supports).
REFERENCE_VENV="${SPBCAST_REFERENCE_VENV:-$HOME/.cache/spbcast/venv-torch2.9}"
REFERENCE_TORCH_VERSION="2.9.1"
DEBIAN_PACKAGES=(build-essential cmake ccache pkg-config python3 python3-venv
                 libboost1.81-dev doctest-dev libtorch-dev libgloo-dev libturbojpeg0-dev
                 iproute2 nftables clang libclang-rt-14-dev)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    echo "setup: Debian packages present"
fi

# One virtual environment: the torch it is for, never upgraded by what follows, torchdata, XTuner
# v1 and its data pipeline's dependencies. populate_venv VENV TORCH_VERSION.
populate_venv() {
    local VENV="$1" TORCH_WHEEL_VERSION="$2"
    # An environment of the earlier layout held XTuner itself, which would hide what a test
    # needs from it: made anew (torch comes from pip's cache).
    if [ -x "$VENV/bin/python" ] && [ ! -f "$VENV/.spbcast-layout-2" ] \
        && "$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("xtuner") is None)'; then
        echo "setup: $VENV holds XTuner (the earlier layout): making it anew"
        rm -rf "$VENV" "$VENV-xtuner"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        echo "setup: creating $VENV"
        python3 -m venv "$VENV"
    fi
    touch "$VENV/.spbcast-layout-2"
    # A package's installed version from its metadata, empty if absent (importing torch to ask
    # would take seconds, on every run of every script that starts here).
    version_of() {
        "$VENV/bin/python" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
    }
    torch_version="$(version_of torch)"
    if [ "${torch_version%%+*}" != "$TORCH_WHEEL_VERSION" ]; then
        echo "setup: installing torch==$TORCH_WHEEL_VERSION into $VENV"
        "$VENV/bin/pip" install -q "torch==$TORCH_WHEEL_VERSION"
        torch_version="$(version_of torch)"
    fi
    # numpy and matplotlib for plots; tensordict is one of the Python peers the benchmarks measure
    # (the main environment only).
    if [ "$VENV" = "$MAIN_VENV" ] && { [ -z "$(version_of numpy)" ] || [ -z "$(version_of matplotlib)" ] \
            || [ -z "$(version_of tensordict)" ]; }; then
        "$VENV/bin/pip" install -q numpy matplotlib "tensordict==0.15.3"
    fi
    echo "setup: PyTorch wheel $torch_version in $VENV"
    # Never let a package below install or upgrade torch: every pip call is constrained to the
    # torch already there.
    constraint="$VENV/.spbcast-torch-constraint.txt"
    echo "torch==$torch_version" > "$constraint"
    # torchdata's StatefulDataLoader, for the loader tests (pure Python).
    if [ -z "$(version_of torchdata)" ]; then
        echo "setup: installing torchdata into $VENV"
        "$VENV/bin/pip" install -q -c "$constraint" torchdata
    fi
    # The drop-ins' trainers, at the versions their tests are proven against (the main environment
    # only): Hugging Face accelerate, transformers (XTuner's pin, so that its overlay adds none of
    # its own), TRL and Megatron-Energon. TRL 0.29.1 is the
    # newest whose datasets bound meets XTuner's datasets<4 (TRL 1.x needs datasets>=4.7).
    # fsspec stays at XTuner's datasets' bound (s3fs follows it).
    if [ "$VENV" = "$MAIN_VENV" ]; then
        dropins=("accelerate==1.15.0" "megatron-energon==7.4.1" "transformers==5.14.1" "trl==0.29.1" "datasets<4")
        if [ "$(version_of accelerate)" != "1.15.0" ] || [ "$(version_of megatron-energon)" != "7.4.1" ] \
                || [ "$(version_of transformers)" != "5.14.1" ] || [ "$(version_of trl)" != "0.29.1" ]; then
            echo "setup: installing ${dropins[*]} into $VENV"
            printf 'fsspec<=2025.3.0\n' > "$VENV/.spbcast-dropins-constraint.txt"
            "$VENV/bin/pip" install -q -c "$constraint" -c "$VENV/.spbcast-dropins-constraint.txt" "${dropins[@]}"
        else
            echo "setup: ${dropins[*]} present in $VENV"
        fi
        # axolotl's plugin API, for test_axolotl.py: axolotl pins its own transformers, accelerate,
        # datasets and TRL (none of the versions above), so peft, pillow and addict - what its plugin
        # API and config code import beyond these - and then axolotl without its dependencies.
        if [ "$(version_of axolotl)" != "0.19.0" ] || [ "$(version_of peft)" != "0.20.0" ] \
                || [ -z "$(version_of addict)" ]; then
            echo "setup: installing peft==0.20.0 and axolotl==0.19.0 (without its dependencies) into $VENV"
            "$VENV/bin/pip" install -q -c "$constraint" -c "$VENV/.spbcast-dropins-constraint.txt" "peft==0.20.0" pillow addict
            "$VENV/bin/pip" install -q --no-deps "axolotl==0.19.0"
        fi
    fi
}

# XTuner v1 for its integration tests (python/tests/test_xtuner*.py), in an overlay beside VENV:
# a virtual environment of its own whose .pth file puts VENV's packages on its path, so it sees
# VENV's torch and spbcast while what XTuner brings stays out of VENV. From a wheel: the one
# SPBCAST_XTUNER_WHEEL names, or ../shared/wheels/xtuner-*.whl beside the repository (built from
# XTuner's GitHub main; PyPI's xtuner is the older code without xtuner/v1). The wheel and mmengine
# without their dependencies (they would pull GPU kernels, OpenCV and matplotlib), then the
# pure-Python ones its data pipeline needs on a CPU machine (../shared/wheels/README.md).
# populate_xtuner_overlay VENV.
populate_xtuner_overlay() {
    local VENV="$1" OVERLAY="$1-xtuner"
    local xtuner_wheel="${SPBCAST_XTUNER_WHEEL:-}"
    if [ -z "$xtuner_wheel" ]; then
        for w in "$(dirname "$0")"/../../shared/wheels/xtuner-*.whl; do
            [ -f "$w" ] && xtuner_wheel="$w"
        done
    fi
    if [ -z "$xtuner_wheel" ]; then
        echo "setup: no XTuner v1 wheel (../shared/wheels/xtuner-*.whl or SPBCAST_XTUNER_WHEEL): its tests will skip"
        return
    fi
    [ -f "$xtuner_wheel" ] || { echo "setup: SPBCAST_XTUNER_WHEEL=$xtuner_wheel is not a file"; exit 1; }
    if [ ! -x "$OVERLAY/bin/python" ]; then
        echo "setup: creating the XTuner overlay $OVERLAY"
        python3 -m venv "$OVERLAY"
        "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
            > "$("$OVERLAY/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/spbcast-base.pth"
    fi
    local xtuner_stamp="$OVERLAY/.spbcast-xtuner-wheel" xtuner_sum
    xtuner_sum="$(sha256sum "$xtuner_wheel" | cut -d' ' -f1)"
    if [ -f "$xtuner_stamp" ] && [ "$(cat "$xtuner_stamp")" = "$xtuner_sum" ]; then
        echo "setup: XTuner v1 ($(basename "$xtuner_wheel")) present in $OVERLAY"
        return
    fi
    local xtuner_deps=(addict termcolor pyyaml rich loguru "transformers==5.14.1" "datasets<4"
                       "fsspec<=2025.3.0" xxhash pillow cyclopts
                       einops more-itertools)  # the last two: XTuner's Trainer (test_xtuner_trainer.py)
    echo "setup: installing XTuner v1 from $xtuner_wheel and its data pipeline's dependencies into $OVERLAY"
    "$OVERLAY/bin/pip" install -q --no-deps "$xtuner_wheel" "mmengine==0.11.0rc2"
    "$OVERLAY/bin/pip" install -q -c "$VENV/.spbcast-torch-constraint.txt" "${xtuner_deps[@]}"
    echo "$xtuner_sum" > "$xtuner_stamp"
}

if [ "$which" = both ] || [ "$which" = main ]; then
    populate_venv "$MAIN_VENV" "$TORCH_WHEEL_VERSION"
    populate_xtuner_overlay "$MAIN_VENV"
    [ "$python_package" = no ] || SPBCAST_VENV="$MAIN_VENV" "$(dirname "$0")/python_package.sh"
fi
if [ "$which" = both ] || [ "$which" = reference ]; then
    # Another setup.sh (test.sh starts one in the background) may be filling it: one at a time.
    mkdir -p "$(dirname "$REFERENCE_VENV")"
    exec 9> "$REFERENCE_VENV.lock"
    flock 9
    populate_venv "$REFERENCE_VENV" "$REFERENCE_TORCH_VERSION"
    populate_xtuner_overlay "$REFERENCE_VENV"
    [ "$python_package" = no ] || SPBCAST_VENV="$REFERENCE_VENV" "$(dirname "$0")/python_package.sh"
fi
# --- ms-swift (spbcast.swift; python/tests/test_swift.py, bench/swift_step.py) -----------------
# An environment of its own: ms-swift 4.6.0 requires datasets>=4, and XTuner's pipeline in the
# main environment pins datasets<4. The main environment's torch (never upgraded: constrained),
# ms-swift at the version its test is proven against with the versions pip resolved for it then,
# and qwen-vl-utils (ms-swift's Qwen2-VL template). The Python package is built into it.
SWIFT_VENV="${SPBCAST_SWIFT_VENV:-$HOME/.cache/spbcast/venv-swift}"
SWIFT_PINS=("ms-swift==4.6.0" "qwen-vl-utils==0.0.14" "transformers==5.19.0" "accelerate==1.16.0"
            "datasets==4.8.4" "peft==0.20.0" "trl==0.29.1")
if [ "$which" = both ] || [ "$which" = swift ]; then
    if [ ! -x "$SWIFT_VENV/bin/python" ]; then
        echo "setup: creating $SWIFT_VENV"
        python3 -m venv "$SWIFT_VENV"
    fi
    swift_stamp="$SWIFT_VENV/.spbcast-swift-pins"
    if [ -f "$swift_stamp" ] && [ "$(cat "$swift_stamp")" = "torch==$TORCH_WHEEL_VERSION ${SWIFT_PINS[*]}" ]; then
        echo "setup: ${SWIFT_PINS[*]} present in $SWIFT_VENV"
    else
        echo "setup: installing torch==$TORCH_WHEEL_VERSION ${SWIFT_PINS[*]} into $SWIFT_VENV"
        "$SWIFT_VENV/bin/pip" install -q "torch==$TORCH_WHEEL_VERSION"
        echo "torch==$TORCH_WHEEL_VERSION" > "$SWIFT_VENV/.spbcast-torch-constraint.txt"
        "$SWIFT_VENV/bin/pip" install -q -c "$SWIFT_VENV/.spbcast-torch-constraint.txt" "${SWIFT_PINS[@]}"
        echo "torch==$TORCH_WHEEL_VERSION ${SWIFT_PINS[*]}" > "$swift_stamp"
    fi
    [ "$python_package" = no ] || SPBCAST_VENV="$SWIFT_VENV" "$(dirname "$0")/python_package.sh"
fi
# -------------------------------------------------------------------------------------------------
echo "setup: done"
