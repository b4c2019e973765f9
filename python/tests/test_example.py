"""The torchrun example of docs/python.md runs, and dedup gives every rank BASE's batches and
generator (examples/python/sp_train.py prints a digest of both per rank)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "sp_train.py")


def _digests(*extra):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", EXAMPLE, "--sp", "2",
                          *extra], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    # Not anchored to line starts: ranks share one stdout, and a line must be found even if a
    # writer elsewhere (torchrun, a library warning) split it.
    found = dict(re.findall(r"rank (\d) \(SP group [^\n]*?digest ([0-9a-f]{16})", out.stdout))
    assert len(found) == 4, out.stdout
    return found


def test_torchrun_example_dedup_equals_base():
    dedup, base = _digests(), _digests("--no-dedup")
    assert dedup == base
    assert dedup["0"] == dedup["1"] and dedup["2"] == dedup["3"] and dedup["0"] != dedup["2"]
