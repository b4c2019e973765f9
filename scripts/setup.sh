#!/usr/bin/env bash
# Installs everything spbcast needs on a fresh Debian 12 machine, by package name:
# the tool chain, Boost >= 1.81 (PFR, Hana), doctest, the distribution's LibTorch with Gloo,
# libjpeg-turbo (the demo), and the PyTorch 2.13.0 CPU wheel in a virtual environment (the
# second LibTorch generation, and the Python peers of the benchmarks).
# Idempotent: a second run checks and returns in seconds.
#   ./scripts/setup.sh                       everything
#   ./scripts/setup.sh --no-python-package   all but the Python package (.ci/run: test.sh builds
#                                            it, on one core, while the other builds a tree)
set -euo pipefail

python_package=yes
case "${1:-}" in
    "") ;;
    --no-python-package) python_package=no ;;
    *) echo "setup: unknown option '$1' (the one option: --no-python-package)"; exit 2 ;;
esac
VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
TORCH_WHEEL_VERSION="2.13.0"
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

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    python3 -m venv "$VENV"
fi
# A package's installed version from its metadata, empty if absent (importing torch to ask
# would take seconds, on every run of every script that starts here).
version_of() {
    "$VENV/bin/python" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}
torch_version="$(version_of torch)"
if [ "${torch_version%%+*}" != "$TORCH_WHEEL_VERSION" ]; then
    echo "setup: installing torch==$TORCH_WHEEL_VERSION (CPU) into $VENV"
    "$VENV/bin/pip" install -q "torch==$TORCH_WHEEL_VERSION"
    torch_version="$(version_of torch)"
fi
# numpy and matplotlib for plots; tensordict is one of the Python peers the benchmarks measure.
if [ -z "$(version_of numpy)" ] || [ -z "$(version_of matplotlib)" ] || [ -z "$(version_of tensordict)" ]; then
    "$VENV/bin/pip" install -q numpy matplotlib "tensordict==0.15.3"
fi
echo "setup: PyTorch wheel $torch_version in $VENV"
# The Python package (python/) and pytest for its tests, into the same environment.
[ "$python_package" = no ] || SPBCAST_VENV="$VENV" "$(dirname "$0")/python_package.sh"
echo "setup: done"
