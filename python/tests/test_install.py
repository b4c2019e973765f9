"""The package where users have it (docs/python.md, "Install"): built with no Boost header
visible, installed by pip's own resolver into a fresh environment holding only torch and the
package's declared requirements, and run there (bare_env_check.py); and a build for one torch
refused by name under another.

The build hides Boost the way a machine without it has none: a mount namespace (root only) lays an
empty directory over every Boost include directory the compiler could search, and the test first
checks that `#include <boost/...>` then fails to compile."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
BOOST_DIRS = [d for d in ("/usr/include/boost", "/usr/local/include/boost") if os.path.isdir(d)]
REFERENCE_PYTHON = pathlib.Path(os.environ.get("SPBCAST_REFERENCE_VENV",
                                               pathlib.Path.home() / ".cache/spbcast/venv-torch2.9")) / "bin/python"


def without_boost(command):
    """`command` (a shell line) in a mount namespace where no Boost header exists."""
    hide = "".join(f"mount -t tmpfs none {d} && " for d in BOOST_DIRS)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide + command]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the system's Boost headers needs a mount namespace: root and unshare")
    work = tmp_path_factory.mktemp("install")
    # A copy of the package and the headers, so that the build writes nothing into the checkout.
    shutil.copytree(REPO / "include", work / "include")
    shutil.copytree(REPO / "python", work / "python", ignore=shutil.ignore_patterns("build", "*.egg-info", "*.so", "__pycache__"))
    probe = subprocess.run(without_boost("echo '#include <boost/hana.hpp>' | c++ -std=c++20 -fsyntax-only -x c++ -"),
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "boost/hana.hpp" in probe.stderr, \
        f"Boost is still visible to the compiler, so the build below would prove nothing:\n{probe.stderr}"
    # Through ccache as scripts/python_package.sh builds, so that this copy of the same sources
    # compiles once. A hit still proves the build needs no Boost: ccache hits only where every
    # header the cached compile read is still there, unchanged.
    env = dict(os.environ, MAX_JOBS="1", CCACHE_BASEDIR=str(work), CCACHE_NOHASHDIR="1")
    if os.path.isdir("/usr/lib/ccache"):
        env["PATH"] = "/usr/lib/ccache:" + env["PATH"]
    build = subprocess.run(without_boost(f"{sys.executable} -m pip wheel -q --no-build-isolation --no-deps "
                                         f"{work / 'python'} -w {work / 'dist'}"),
                           capture_output=True, text=True, env=env, cwd=work)
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = (work / "dist").glob("spbcast-*.whl")
    return built


def test_wheel_builds_without_boost_and_runs_with_torch_alone(wheel, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    install = subprocess.run([venv / "bin/pip", "install", "-q", "--disable-pip-version-check",
                              f"torch=={torch.__version__}", wheel], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    # From a directory with no spbcast in it: the installed wheel is what imports. dist_harness
    # (torch only) is the one test module it borrows.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(tmp_path / "harness")
    (tmp_path / "harness").mkdir()
    for name in ("bare_env_check.py", "dist_harness.py"):
        shutil.copy(REPO / "python/tests" / name, tmp_path / "harness" / name)
    check = subprocess.run([venv / "bin/python", tmp_path / "harness/bare_env_check.py"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert check.returncode == 0 and "bare environment: ok" in check.stdout, check.stdout + check.stderr


def test_a_build_for_another_torch_is_refused_by_name(tmp_path):
    """This environment's spbcast (built for this torch) imported under the reference torch."""
    if not REFERENCE_PYTHON.exists():
        pytest.skip(f"no second torch at {REFERENCE_PYTHON} (scripts/setup.sh installs PyTorch 2.9.1 there)")
    import spbcast

    shutil.copytree(pathlib.Path(spbcast.__file__).parent, tmp_path / "spbcast")
    result = subprocess.run([REFERENCE_PYTHON, "-c", "import torch; print(torch.__version__); import spbcast"],
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    other = result.stdout.split()[0]
    assert other != torch.__version__, "the reference environment runs this same torch"
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: spbcast: this spbcast was built for torch " + torch.__version__), message
    assert f"runs torch {other}" in message and "pip install --no-build-isolation" in message, message
