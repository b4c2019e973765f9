#!/usr/bin/env bash
# Installs what spbcast's scripts need on a fresh Debian 12 machine, by package name, and no more
# than the command asks for. Each step prints its time; a second run checks and returns in seconds.
#   ./scripts/setup.sh                   everything: the Debian packages and every environment
#   ./scripts/setup.sh demo              what scripts/demo.sh needs: the tool chain, Boost, the
#                                        distribution's LibTorch, libjpeg-turbo, and numpy and
#                                        matplotlib for its plot
#   ./scripts/setup.sh NAME...           the Debian packages the tests need and these environments
#                                        (scripts/environments.sh: main reference swift verl demo),
#                                        each with the Python package built into it
#   --no-python-package                  all but building the Python package (.ci/run: test.sh
#                                        builds it on one core while the other builds a tree)
# The environments are made with uv (installed from PyPI into $HOME/.cache/spbcast/tools): it
# downloads each wheel once into its cache and installs from there by hard links, so a second
# environment with the same torch takes seconds. Each is made from scripts/envs/<name>.txt (and
# <name>.no-deps.txt, installed without dependencies), and made anew when those files change.
# Where XTuner v1 is at hand (../shared/wheels/xtuner-*.whl or $SPBCAST_XTUNER_WHEEL), the main
# and reference environments get an XTuner overlay beside them (<venv>-xtuner: XTuner and what it
# brings, over the environment's own packages), so that the environment itself holds only what
# spbcast's tests declare and a test that leans on something XTuner brings fails
# (docs/building.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/environments.sh

python_package=yes
wanted=()
for option in "$@"; do
    case "$option" in
        --no-python-package) python_package=no ;;
        -*) echo "setup: unknown option '$option' (--no-python-package, or environments: ${SPBCAST_ENVIRONMENTS[*]})"; exit 2 ;;
        *) environment_dir "$option" > /dev/null || exit 2
           wanted+=("$option") ;;
    esac
done
[ ${#wanted[@]} -gt 0 ] || wanted=("${SPBCAST_ENVIRONMENTS[@]}")

started=$(date +%s%N)
seconds_since() { awk -v from="$1" -v to="$(date +%s%N)" 'BEGIN { printf "%.1f s", (to - from) / 1e9 }'; }
# timed WHAT COMMAND...: says what it starts, runs it, and says how long it took.
timed() {
    local what="$1" start
    shift
    start=$(date +%s%N)
    echo "setup: $what"
    "$@"
    echo "setup: $what: $(seconds_since "$start")"
}

# --- Debian packages ------------------------------------------------------------------------------
# The demo builds one program against the distribution's LibTorch; the tests add doctest, the
# namespaces' network tools and clang's sanitizer and fuzzer runtimes.
DEMO_PACKAGES=(build-essential cmake ccache pkg-config python3 python3-venv
               libboost1.81-dev libtorch-dev libgloo-dev libturbojpeg0-dev)
TEST_PACKAGES=(doctest-dev iproute2 nftables clang libclang-rt-14-dev)
packages=("${DEMO_PACKAGES[@]}")
[ "${wanted[*]}" = demo ] || packages+=("${TEST_PACKAGES[@]}")
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
install_debian_packages() {
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" > /dev/null
}
if [ ${#missing[@]} -gt 0 ]; then
    timed "installing Debian packages: ${missing[*]}" install_debian_packages "${missing[@]}"
else
    echo "setup: Debian packages present"
fi

# --- uv, and the indexes pip is configured with ------------------------------------------------
TOOLS="$HOME/.cache/spbcast/tools"
UV_VERSION=0.13.10
UV="$TOOLS/bin/uv"
install_uv() {
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q "uv==$UV_VERSION"
}
if [[ "$("$UV" --version 2>/dev/null)" != "uv $UV_VERSION "* ]]; then
    timed "installing uv $UV_VERSION into $TOOLS" install_uv
fi
# uv reads no pip.conf: it gets the wheel folders and indexes that pip has here, so that both
# install the same packages (pip takes the best version across every index, and so does uv with
# unsafe-best-match). The interpreter is python3's; uv never downloads one.
pip_setting() {  # pip_setting NAME: PIP_<NAME>, else pip's configured global.<name>
    local variable="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!variable:-}" ]; then echo "${!variable}"; else "$TOOLS/bin/pip" config get "global.$1" 2>/dev/null || true; fi
}
find_links="$(pip_setting find-links)"
index_url="$(pip_setting index-url)"
extra_index_url="$(pip_setting extra-index-url)"
cert="$(pip_setting cert)"
[ -z "$find_links" ] || export UV_FIND_LINKS="${UV_FIND_LINKS:-$find_links}"
[ -z "$index_url" ] || export UV_INDEX_URL="${UV_INDEX_URL:-$index_url}"
[ -z "$extra_index_url" ] || export UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-$extra_index_url}" \
    UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}"
[ -z "$cert" ] || export SSL_CERT_FILE="${SSL_CERT_FILE:-$cert}"
export UV_PYTHON_DOWNLOADS=never
# Bytecode compiled at install, as pip does (uv does not by default): where
# PYTHONDONTWRITEBYTECODE is set, as on CI's machines, every process would otherwise compile the
# sources of torch and the trainers again as it imports them - twice the CPU of an import, in the
# hundreds of rank processes the tests start.
export UV_COMPILE_BYTECODE=1
PYTHON="$(python3 -c 'import sys; print(sys.executable)')"

# --- the environments ----------------------------------------------------------------------------
# make_environment NAME: the environment from scripts/envs/NAME.txt (and NAME.no-deps.txt), made
# anew when those files change; one set-up at a time per environment (test.sh fills some in the
# background while a script in the foreground may ask for one).
make_environment() {
    local name="$1" dir requirements no_deps stamp wanted_stamp lock
    dir="$(environment_dir "$name")"
    requirements="scripts/envs/$name.txt"
    no_deps="scripts/envs/$name.no-deps.txt"
    mkdir -p "$(dirname "$dir")"
    exec {lock}> "$dir.lock"
    flock "$lock"
    stamp="$dir/.spbcast-environment"
    wanted_stamp="$PYTHON $(cat scripts/envs/test-tools.txt "$requirements" "$([ -f "$no_deps" ] && echo "$no_deps" || echo /dev/null)" | sha256sum | cut -c1-16)"
    if [ -x "$dir/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted_stamp" ]; then
        echo "setup: environment $name up to date in $dir"
    else
        timed "making environment $name in $dir from $requirements" fill_environment "$dir" "$requirements" "$no_deps"
        echo "$wanted_stamp" > "$stamp"
    fi
    exec {lock}>&-
}
fill_environment() {  # fill_environment DIR REQUIREMENTS NO_DEPS
    # --seed: pip too, which users of the environment (and the package's build) call.
    [ -x "$1/bin/python" ] || "$UV" venv -q --seed -p "$PYTHON" "$1"
    "$UV" pip install -q -p "$1/bin/python" -r "$2"
    [ ! -f "$3" ] || "$UV" pip install -q -p "$1/bin/python" --no-deps -r "$3"
}

# XTuner v1 for its integration tests (python/tests/test_xtuner*.py), in an overlay beside VENV:
# a virtual environment of its own whose .pth file puts VENV's packages on its path, so it sees
# VENV's torch and spbcast while what XTuner brings stays out of VENV. From a wheel: the one
# SPBCAST_XTUNER_WHEEL names, or ../shared/wheels/xtuner-*.whl beside the repository (built from
# XTuner's GitHub main; PyPI's xtuner is the older code without xtuner/v1). The wheel and mmengine
# without their dependencies (they would pull GPU kernels, OpenCV and matplotlib), then the
# pure-Python ones its data pipeline needs on a CPU machine (../shared/wheels/README.md).
# make_xtuner_overlay VENV.
XTUNER_DEPENDENCIES=(addict termcolor pyyaml rich loguru "transformers==5.14.1" "datasets<4"
                     "fsspec<=2025.3.0" xxhash pillow cyclopts
                     einops more-itertools)  # the last two: XTuner's Trainer (test_xtuner_trainer.py)
make_xtuner_overlay() {
    local venv="$1" overlay="$1-xtuner" wheel="${SPBCAST_XTUNER_WHEEL:-}" stamp wanted_stamp
    if [ -z "$wheel" ]; then
        for w in ../shared/wheels/xtuner-*.whl; do
            [ -f "$w" ] && wheel="$w"
        done
    fi
    if [ -z "$wheel" ]; then
        echo "setup: no XTuner v1 wheel (../shared/wheels/xtuner-*.whl or SPBCAST_XTUNER_WHEEL): its tests will skip"
        return
    fi
    [ -f "$wheel" ] || { echo "setup: SPBCAST_XTUNER_WHEEL=$wheel is not a file"; exit 1; }
    stamp="$overlay/.spbcast-xtuner-wheel"
    wanted_stamp="$(sha256sum "$wheel" | cut -d' ' -f1) ${XTUNER_DEPENDENCIES[*]}"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted_stamp" ]; then
        echo "setup: XTuner v1 ($(basename "$wheel")) present in $overlay"
        return
    fi
    timed "installing XTuner v1 from $wheel and its data pipeline's dependencies into $overlay" \
        fill_xtuner_overlay "$venv" "$overlay" "$wheel"
    echo "$wanted_stamp" > "$stamp"
}
fill_xtuner_overlay() {  # fill_xtuner_overlay VENV OVERLAY WHEEL
    local venv="$1" overlay="$2"
    if [ ! -x "$overlay/bin/python" ]; then
        "$UV" venv -q --seed -p "$PYTHON" "$overlay"
        "$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
            > "$("$overlay/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/spbcast-base.pth"
    fi
    # uv does not look through the .pth file, so it installs here again what these need from the
    # environment: held to the environment's versions (never a torch of its own), but for the
    # packages named above, which take their own bounds.
    local named
    named="$(printf '%s\n' spbcast "${XTUNER_DEPENDENCIES[@]}" | sed 's/[<>=!].*//' | paste -sd'|')"
    "$UV" pip freeze -q -p "$venv/bin/python" | grep -v -i -E "^($named)( |==|$)" \
        > "$overlay/.spbcast-base-constraint.txt"
    "$UV" pip install -q -p "$overlay/bin/python" --no-deps "$3" "mmengine==0.11.0rc2"
    "$UV" pip install -q -p "$overlay/bin/python" -c "$overlay/.spbcast-base-constraint.txt" "${XTUNER_DEPENDENCIES[@]}"
}

for name in "${wanted[@]}"; do
    make_environment "$name"
    dir="$(environment_dir "$name")"
    case "$name" in main | reference) make_xtuner_overlay "$dir" ;; esac
    if [ "$python_package" = yes ] && [ "$name" != demo ]; then
        SPBCAST_VENV="$dir" scripts/python_package.sh
    fi
done
echo "setup: done in $(seconds_since "$started")"
