"""spbcast.verl proven against the real verl (0.9.1, in the environment scripts/envs/verl.txt
describes): verl's own ``SFTTrainer`` on 4 Gloo ranks on CPU, dp 2 x Ulysses sp 2 (SP groups (0, 1)
and (2, 3)), its ``MultiTurnSFTDataset``, ``SFTTensorCollator`` (``pad_mode: no_padding``: jagged
nested tensors; and ``right``), ``StatefulDataLoader`` with 2 and 0 DataLoader workers, ``fit()``
over two epochs and its ``CheckpointHandler`` - BASE (verl as shipped: every SP rank reads every
sample of its dp slot) against dedup (``spbcast.verl.enable()``: only the SP leaders, ranks 0
and 2, read). What is stood in for - verl's model engine alone, which cannot train on CPU
ranks - verl_ranks.py says, and why.

Every rank's batch as ``fit()`` hands it to the engine at every step, bit for bit, and its default
CPU generator there; the samples read in every process (DataLoader workers included); the
checkpoint's ``data_<dp>.pt``; resumed from the step-3 checkpoint in new processes, BASE and dedup
checkpoints either way. Refusals are one clear error on every rank.

The ranks are forked from this process, which imports verl once (verl_ranks.py)."""

import os

import pytest

pytest.importorskip("verl", reason="verl is not installed (its environment: scripts/envs/verl.txt; "
                    "scripts/test.sh runs this test there)")
import importlib.util  # noqa: E402

import torch  # noqa: E402

from batches import assert_same  # noqa: E402

# verl's image fetch (not imported here: it needs torchvision, verl_ranks.py)
MULTIMODAL = importlib.util.find_spec("qwen_vl_utils") is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import verl_ranks as vr

    root = str(tmp_path_factory.mktemp("verl"))
    A = vr.Arm
    continuous = [
        A("base", False), A("base_w0", False, workers=0), A("base_right", False, pad_mode="right"),
        *([A("base_vl", False, steps=3, multimodal=True)] if MULTIMODAL else []),
        A("dedup", True), A("dedup_w0", True, workers=0), A("dedup_right", True, pad_mode="right"),
        *([A("dedup_vl", True, steps=3, multimodal=True)] if MULTIMODAL else []),
        A("sp1", True, sp=1, expect_error=True), A("megatron", True, engine="megatron", expect_error=True),
        A("unknown_option", True, options={"prefetch_depth": 1}, expect_error=True)]
    resumed = [  # new processes; "a@b": a resumed from b's checkpoint after step 3 of 6
        A("base@base", False, resume="base"), A("base@dedup", False, resume="dedup"),
        A("dedup@base", True, resume="base"), A("dedup@dedup", True, resume="dedup")]
    records = vr.run_arms(root, "continuous", continuous)
    records.update(vr.run_arms(root, "resumed", resumed))
    return root, records


def same_steps(expected, got, where, last=None):
    """Every step's batch (as fit() gave it to the engine) and the generator there, on one rank."""
    steps = expected["steps"] if last is None else expected["steps"][-last:]
    assert len(got["steps"]) == len(steps) > 0, f"{where}: {len(got['steps'])} steps"
    for step, (e, g) in enumerate(zip(steps, got["steps"])):
        assert e["batch"] == g["batch"], f"{where}: the batch of step {step + 1}"
        assert torch.equal(e["rng"], g["rng"]), f"{where}: the generator at step {step + 1}"
    assert torch.equal(expected["rng"], got["rng"]), f"{where}: the generator after fit()"
    assert_same(expected["state"], got["state"], f"{where}: the loader's state_dict() after fit()")


def only_leaders_read(arm, records, workers=True):
    import verl_ranks as vr
    from calls_counted import assert_only_leaders

    assert_only_leaders(arm, records, vr.LEADERS, vr.FOLLOWERS, "reads", "read", workers)


@pytest.mark.parametrize("variant", ["", "_w0", "_right"])
def test_fit_batches_equal_base(runs, variant):
    """fit()'s 6 steps over two epochs (4 a pass): every rank's batches, generators and the loader's
    state are BASE's, bit for bit; the loader keeps its class and len(); only the leaders read."""
    _, records = runs
    base, dedup = records[f"base{variant}"], records[f"dedup{variant}"]
    for rank, (b, d) in enumerate(zip(base, dedup)):
        same_steps(b, d, f"dedup{variant}, rank {rank}")
        assert b["len"] == d["len"] == 4
        assert b["class"] == d["class"] == "StatefulDataLoader"
        assert b["reads"] >= 18, f"base{variant}, rank {rank}: BASE reads every sample it trains on"
    for leader, follower in ((0, 1), (2, 3)):  # BASE: the ranks of an SP group get the same batches
        assert [s["batch"] for s in base[leader]["steps"]] == [s["batch"] for s in base[follower]["steps"]]
    assert base[0]["steps"][0]["batch"] != base[2]["steps"][0]["batch"]  # dp slots differ
    assert base[0]["steps"][0]["batch"] != base[0]["steps"][4]["batch"]  # set_epoch reached the sampler
    only_leaders_read(f"dedup{variant}", dedup, workers=variant != "_w0")
    assert all(r["stats"] is not None for r in dedup) and all(r["stats"] is None for r in base)


def test_no_padding_batches_are_jagged(runs):
    """verl's default pad_mode: the batches fit() trains on hold jagged nested tensors."""
    _, records = runs
    batch = records["dedup"][1]["steps"][0]["batch"]  # a follower's: what it received
    assert batch[0] == "tensordict" and batch[2]["input_ids"][0] == "nested"
    assert "jagged" in batch[2]["input_ids"][1]


@pytest.mark.skipif(not MULTIMODAL, reason="qwen-vl-utils is not installed (verl's image fetch; "
                    "scripts/envs/verl.txt pins it)")
def test_multimodal_batches_equal_base(runs):
    """Image samples through verl's processor path (a Qwen2-VL processor: its image processor,
    qwen_vl_utils' fetch, the mrope position ids) with 2 workers: every rank's batches, generators
    and loader state are BASE's, bit for bit - the nested tensors' values, offsets and ragged
    dimension (position_ids: 4 x seq per sample, ragged in dimension 2), and pixel_values and
    image_grid_thw in the multi_modal_inputs stack; the checkpoint's data_<dp>.pt; only the leaders
    read (decode) samples."""
    root, records = runs
    base, dedup = records["base_vl"], records["dedup_vl"]
    for rank, (b, d) in enumerate(zip(base, dedup)):
        same_steps(b, d, f"dedup_vl, rank {rank}")
    only_leaders_read("dedup_vl", dedup)
    for dp in (0, 1):  # the checkpoint after step 3
        name = os.path.join("global_step_3", f"data_{dp}.pt")
        assert_same(torch.load(os.path.join(root, "base_vl", name), weights_only=False),
                    torch.load(os.path.join(root, "dedup_vl", name), weights_only=False), f"vl: {name}")
    batch = dedup[1]["steps"][0]["batch"][2]  # a follower's TensorDict, as it received it
    kind, layout, _, ragged_idx, values, offsets = batch["position_ids"]
    assert (kind, layout, ragged_idx, values[2][0]) == ("nested", "torch.jagged", 2, 4), batch["position_ids"]
    assert offsets[2] == (4,), "3 samples a batch"
    stack = batch["multi_modal_inputs"]
    assert stack[0] == "stack" and len(stack[1]) == 3
    for sample in stack[1]:
        assert sample["pixel_values"][1] == "torch.float32" and sample["pixel_values"][2][0] > 0
        assert sample["image_grid_thw"][1] == "torch.int64" and sample["image_grid_thw"][2][1] == 3


def test_prefetch_where_exact(runs):
    """The leader fetches ahead with DataLoader workers (verl's DistributedSampler draws from its
    own generator), not with num_workers=0 (the dataset runs on the trainer's process)."""
    _, records = runs
    assert [r["stats"]["prefetch"] for r in records["dedup"]] == [1] * 4
    assert [r["stats"]["prefetch"] for r in records["dedup_w0"]] == [0] * 4
    assert all(r["stats"]["steps"] == 6 for r in records["dedup"])


def test_checkpoints_equal_base(runs):
    """verl's CheckpointHandler writes data_<dp>.pt from SP rank 0: dedup's equal BASE's, at both
    checkpoints (mid-epoch, step 3; and step 6, in the second epoch)."""
    root, _ = runs
    for step in (3, 6):
        for dp in (0, 1):
            name = os.path.join(f"global_step_{step}", f"data_{dp}.pt")
            base = torch.load(os.path.join(root, "base", name), weights_only=False)
            dedup = torch.load(os.path.join(root, "dedup", name), weights_only=False)
            assert base, name
            assert_same(base, dedup, name)


def test_resume_across_the_switch(runs):
    """Resumed from the step-3 checkpoint in new processes (verl's CheckpointHandler loads
    data_<dp>.pt on every rank, followers included): dedup from BASE's, BASE from dedup's, dedup from
    its own, go on exactly as BASE from BASE's - which goes on as the continuous run."""
    _, records = runs
    reference = records["base@base"]
    for rank, (e, g) in enumerate(zip(records["base"], reference)):
        for step, (es, gs) in enumerate(zip(e["steps"][3:], g["steps"])):
            assert es["batch"] == gs["batch"], f"base@base, rank {rank}: step {step + 4}"
    for arm in ("base@dedup", "dedup@base", "dedup@dedup"):
        for rank, (e, g) in enumerate(zip(reference, records[arm])):
            same_steps(e, g, f"{arm}, rank {rank}")
            assert len(g["steps"]) == 3
    only_leaders_read("dedup@base", records["dedup@base"])
    only_leaders_read("dedup@dedup", records["dedup@dedup"])


@pytest.mark.parametrize("arm, says", [
    ("sp1", "ulysses_sequence_parallel_size 1"),
    ("megatron", "verl's 'megatron' engine"),
    ("unknown_option", "'prefetch_depth'"),
])
def test_refusals_are_clear_on_every_rank(runs, arm, says):
    from dist_harness import assert_refused_on_every_rank

    assert_refused_on_every_rank(runs[1][arm], "spbcast.verl", says)


def test_import_spbcast_does_not_import_verl():
    import subprocess
    import sys

    code = "import sys, spbcast, spbcast.verl; assert 'verl' not in sys.modules, 'imported verl'"
    subprocess.run([sys.executable, "-c", code], check=True)
