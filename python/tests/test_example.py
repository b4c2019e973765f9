"""The torchrun examples of docs/python.md run, and dedup gives every rank BASE's batches and
generator: examples/python/sp_train.py prints a digest of both per rank; examples/python/train.py,
the plain PyTorch trainer docs/python.md opens with, also its final parameters, and records every
step's batch digest (--record), through a checkpoint and a resume in new processes."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "python", "sp_train.py")
TRAIN = os.path.join(ROOT, "examples", "python", "train.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(script, *extra, cwd=None):
    # 4 ranks, 2 DataLoader workers per loading rank, on a machine that may be busy: generous.
    out = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "4", script, "--sp", "2",
                          *extra], capture_output=True, text=True, timeout=300, cwd=cwd,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _digests(*extra):
    out = _torchrun(EXAMPLE, *extra)
    # Not anchored to line starts: ranks share one stdout, and a line must be found even if a
    # writer elsewhere (torchrun, a library warning) split it.
    found = dict(re.findall(r"rank (\d) \(SP group [^\n]*?digest ([0-9a-f]{16})", out.stdout))
    assert len(found) == 4, out.stdout
    return found


def test_torchrun_example_dedup_equals_base():
    dedup, base = _digests(), _digests("--no-dedup")
    assert dedup == base
    assert dedup["0"] == dedup["1"] and dedup["2"] == dedup["3"] and dedup["0"] != dedup["2"]


# examples/python/train.py: DP 2 x SP 2, 64 samples, batches of 4: 8 steps an epoch, 2 epochs.
STEPS, SAVE_AT = 16, 5  # the checkpoint mid-epoch 0; the resume redoes none of it


def _train(tmp, name, *extra):
    """One run of train.py: its --record (a list by rank) and its stdout."""
    record = os.path.join(tmp, f"{name}.json")
    out = _torchrun(TRAIN, "--record", record, *extra, cwd=tmp)
    with open(record) as f:
        ranks = json.load(f)
    for r, mine in enumerate(ranks):  # the printed line says the same as the record
        assert re.search(rf"rank {r} \(SP group {re.escape(str(mine['sp_group']))}, DP group "
                         rf"{re.escape(str(mine['dp_group']))}\) batches [0-9a-f]{{16}} params "
                         rf"{mine['params']} rng {mine['rng']}", out.stdout), out.stdout
    return ranks, out.stdout + out.stderr


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    """Both modes, 2 epochs without a break, each writing a checkpoint after step SAVE_AT."""
    tmp = str(tmp_path_factory.mktemp("train"))
    return tmp, {mode: _train(tmp, mode, f"--{mode}", "--save-at", str(SAVE_AT),
                              "--ckpt-dir", os.path.join(tmp, f"ckpt-{mode}"))[0]
                 for mode in ("dedup", "no-dedup")}


def test_train_dedup_equals_base(continuous):
    _, runs = continuous
    dedup, base = runs["dedup"], runs["no-dedup"]
    assert [r["leader"] for r in dedup] == [True, False, True, False]
    # Only the SP leaders built a DataLoader; in BASE every rank did.
    assert [r["built"] for r in dedup] == [True, False, True, False]
    assert [r["built"] for r in base] == [True] * 4
    for r in range(4):  # every step's batch, the final parameters and generator: BASE's
        assert list(dedup[r]["steps"]) == [str(s) for s in range(1, STEPS + 1)]
        for key in ("steps", "params", "rng", "sp_group", "dp_group", "skipped"):
            assert dedup[r][key] == base[r][key], (r, key)
    assert dedup[0]["sp_group"] == [0, 1] and dedup[0]["dp_group"] == [0, 2]
    # One SP group sees one batch a step; the two DP replicas load different shards.
    assert dedup[0]["steps"] == dedup[1]["steps"] and dedup[2]["steps"] == dedup[3]["steps"]
    assert not set(dedup[0]["steps"].values()) & set(dedup[2]["steps"].values())
    # The DP gradient average keeps every replica's parameters equal.
    assert len({r["params"] for r in dedup}) == 1


@pytest.mark.parametrize("mode", ["dedup", "no-dedup"])
def test_train_resume_equals_continuous(continuous, mode):
    tmp, runs = continuous
    resumed, output = _train(tmp, f"{mode}-resumed", f"--{mode}", "--resume",
                             "--ckpt-dir", os.path.join(tmp, f"ckpt-{mode}"))
    assert "ResumeWarning" not in output  # a DataLoader with a RandomSampler resumes exactly
    for r in range(4):
        whole = runs[mode][r]
        assert list(resumed[r]["steps"]) == [str(s) for s in range(SAVE_AT + 1, STEPS + 1)]
        assert resumed[r]["steps"] == {k: v for k, v in whole["steps"].items() if int(k) > SAVE_AT}
        assert resumed[r]["params"] == whole["params"] and resumed[r]["rng"] == whole["rng"], r


def test_train_skips_a_failing_sample_on_every_dp_replica(tmp_path):
    """Sample 10 (DP replica 0's shard) raises ValueError in the dataset, once an epoch: the SP
    group [0, 1] gets the error on both ranks (spbcast.LoaderError with dedup, the DataLoader's
    ValueError in BASE), and both DP replicas skip that step, agreeing over the DP group."""
    runs = {mode: _train(str(tmp_path), mode, f"--{mode}", "--bad-index", "10")[0]
            for mode in ("dedup", "no-dedup")}
    dedup, base = runs["dedup"], runs["no-dedup"]
    skipped = dedup[0]["skipped"]
    assert len(skipped) == 2 and skipped[0] <= STEPS // 2 < skipped[1]  # one step an epoch
    for r in range(4):
        assert dedup[r]["skipped"] == base[r]["skipped"] == skipped
        assert dedup[r]["params"] == base[r]["params"] and dedup[r]["rng"] == base[r]["rng"]
        for step in map(str, skipped):
            if r < 2:  # the failing SP group: the error on the follower too
                assert dedup[r]["steps"][step] == "spbcast.LoaderError"
                assert base[r]["steps"][step] == "ValueError"
            else:  # the other DP replica had its batch and skipped it too
                assert re.fullmatch("[0-9a-f]{16}", dedup[r]["steps"][step])
        batches = [k for k in dedup[r]["steps"] if r >= 2 or int(k) not in skipped]
        assert [dedup[r]["steps"][k] for k in batches] == [base[r]["steps"][k] for k in batches]
    assert len({r["params"] for r in dedup}) == 1
