#!/usr/bin/env bash
# Builds and installs the Python package (python/) into one of the project's virtual environments
# (scripts/setup.sh makes them, with pytest for its tests). Idempotent: it rebuilds only when the
# package's sources or the core headers changed since the last install.
#   ./scripts/python_package.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
# Checks by metadata, not by import: importing torch takes seconds.
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
# The build's own requirement (python/pyproject.toml; the build is not isolated, so that it
# compiles against this environment's torch), which scripts/setup.sh installs with the test tools.
has setuptools.command.bdist_wheel || { echo "setup: $VENV has no setuptools>=70.1: make it with scripts/setup.sh"; exit 1; }
stamp="$VENV/.spbcast-python-package"
# The sources, the torch and the Python a build is for: environments that share all three (the
# main one and the trainers' own, on the same torch wheel) share one built wheel.
sources=$( (find python/setup.py python/pyproject.toml python/spbcast python/csrc include/spbcast -type f \
             \( -name '*.py' -o -name '*.cpp' -o -name '*.hpp' -o -name '*.toml' \) -print0 \
           | sort -z | xargs -0 sha256sum
           "$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version("torch"), sys.version)') \
         | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sources" ] && has spbcast; then
    echo "setup: Python package spbcast up to date in $VENV"
    exit 0
fi
# One build at a time in this checkout: pip builds in python/build, which a second build (test.sh
# fills environments in the background) would remove under the first.
exec 8< "$0"
flock 8
SECONDS=0
built="$HOME/.cache/spbcast/wheels/$sources"
if ! ls "$built"/spbcast-*.whl > /dev/null 2>&1; then
    echo "setup: building the Python package spbcast for $VENV (about 45 s)"
    # One compile job: the extension is one source file. torch's build calls `c++`: ccache's
    # folder of compiler links, first in PATH, makes that ccache, and the hash leaves out the
    # folder built in (the flags hold -g), so the same sources built elsewhere - test_install.py
    # builds a copy - compile once.
    export MAX_JOBS=1 CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
    if [ -d /usr/lib/ccache ]; then export PATH="/usr/lib/ccache:$PATH"; fi
    rm -rf "$built.partial"
    "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps ./python -w "$built.partial" > python-package.build.log 2>&1 \
        || { cat python-package.build.log; exit 1; }
    rm -rf python/build python/spbcast.egg-info
    mv "$built.partial" "$built"
fi
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$built"/spbcast-*.whl
echo "$sources" > "$stamp"
echo "setup: Python package spbcast installed into $VENV: $SECONDS s"
