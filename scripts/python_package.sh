#!/usr/bin/env bash
# Builds and installs the Python package (python/) into the project's virtual environment, with
# pytest for its tests. Idempotent: it rebuilds only when the package's sources or the core
# headers changed since the last install.
#   ./scripts/python_package.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPBCAST_VENV:-$HOME/.cache/spbcast/venv}"
# Checks by metadata, not by import: importing torch takes seconds.
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! has pytest; then
    echo "setup: installing pytest into $VENV"
    "$VENV/bin/pip" install -q pytest
fi
# hypothesis: the property-based fuzz target of the Python decoder (scripts/fuzz_python.sh).
if ! has hypothesis; then
    echo "setup: installing hypothesis into $VENV"
    "$VENV/bin/pip" install -q "hypothesis==6.170.15"
fi
# The build's own requirement (python/pyproject.toml; the build is not isolated, so that it
# compiles against this environment's torch): a setuptools that builds wheels by itself.
if ! has setuptools.command.bdist_wheel; then
    echo "setup: installing setuptools>=70.1 into $VENV"
    "$VENV/bin/pip" install -q "setuptools>=70.1"
fi
stamp="$VENV/.spbcast-python-package"
sources=$( (find python/setup.py python/pyproject.toml python/spbcast python/csrc include/spbcast -type f \
             \( -name '*.py' -o -name '*.cpp' -o -name '*.hpp' -o -name '*.toml' \) -print0 \
           | sort -z | xargs -0 sha256sum
           "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))') \
         | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sources" ] && has spbcast; then
    echo "setup: Python package spbcast up to date in $VENV"
    exit 0
fi
# One build at a time in this checkout: pip builds in python/build, which a second build (test.sh
# fills the reference environment in the background) would remove under the first.
exec 8< "$0"
flock 8
echo "setup: building the Python package spbcast into $VENV (about 30 s)"
# One compile job: the extension is one source file (torch's build runs it through ccache
# when ccache is installed).
export MAX_JOBS=1 CCACHE_BASEDIR="$PWD"
"$VENV/bin/pip" install -q --no-build-isolation --no-deps ./python > python-package.build.log 2>&1 \
    || { cat python-package.build.log; exit 1; }
rm -rf python/build python/spbcast.egg-info
echo "$sources" > "$stamp"
