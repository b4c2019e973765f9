"""spbcast.accelerate proven against the real Hugging Face accelerate and transformers' Trainer (the
versions scripts/setup.sh pins): 4 Gloo ranks on CPU with the device mesh (dp_shard 2, tp 2) - or
(dp_shard 2, cp 2), the CP groups of axolotl's context parallelism - given to the accelerator, BASE (accelerate as shipped: every rank loads) against dedup
(``spbcast.accelerate.enable``: only the TP leaders, ranks 0 and 2, load).

accelerate's own loop (prepare, gradient accumulation 2, two epochs, then ``skip_first_batches``):
per step and rank, bit for bit, the batch, ``end_of_dataloader``, ``remainder``, ``sync_gradients``
and ``torch.get_rng_state()``; ``len()``; the final parameters - with 0 and 2 DataLoader workers
(prefetch on), and with ``use_stateful_dataloader`` (a seedable sampler, data_seed, uneven
batches: ``state_dict()`` per step too) saved by ``accelerator.save_state`` and loaded in new
processes across the switch. The real ``Trainer.train()`` of a tiny Llama built from a config:
per micro-step the inputs and the loss, per optimizer step the grad norm and the generator, the
final parameters; resumed from its mid-epoch checkpoint (``skip_first_batches``) in new processes,
BASE and dedup checkpoints either way. With worker-side randomness (workers seeded by global rank,
as the Trainer seeds them), BASE gives the ranks of a TP pair different batches and dedup the
leader's. Followers' datasets read no sample. Refusals are one clear error on every rank.

The ranks are forked from this process, which imports accelerate and transformers once
(accelerate_ranks.py)."""

import os

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup.sh installs accelerate==1.15.0 "
                    "into the main environment)")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it)")

import torch  # noqa: E402

from batches import assert_same  # noqa: E402

LOOP = {"workers": 2, "noise": True}
CP = {"workers": 2, "shared_dim": "cp"}  # the (dp_shard 2, cp 2) mesh: axolotl's context parallelism
STATEFUL = {"workers": 2, "stateful": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import accelerate_ranks as ar

    root = str(tmp_path_factory.mktemp("accelerate"))
    L, T = ar.LoopArm, ar.TrainerArm
    continuous = [
        L("loop_base", False), L("loop_dedup", True),
        L("loop_base_noisy", False, **LOOP), L("loop_dedup_noisy", True, **LOOP),
        L("loop_base_stateful", False, **STATEFUL), L("loop_dedup_stateful", True, **STATEFUL),
        L("loop_base_cp", False, **CP), L("loop_dedup_cp", True, **CP),
        L("loop_no_mesh", True, mesh=False),
        L("loop_dispatch", True, dispatch=True, expect_error=True),
        L("loop_unknown_option", True, options={"prefetch_depth": 1}, expect_error=True),
        T("trainer_base", False), T("trainer_dedup", True),
        T("trainer_base2", False, workers=2), T("trainer_dedup2", True, workers=2),
        T("trainer_base_noisy", False, workers=2, noise=True), T("trainer_dedup_noisy", True, workers=2, noise=True)]
    resumed = [  # new processes; "a@b": a resumed from what b saved
        L("loop_base_stateful@base", False, resume="loop_base_stateful", **STATEFUL),
        L("loop_dedup_stateful@base", True, resume="loop_base_stateful", **STATEFUL),
        L("loop_base_stateful@dedup", False, resume="loop_dedup_stateful", **STATEFUL),
        T("trainer_dedup@base", True, resume="trainer_base"), T("trainer_base@dedup", False, resume="trainer_dedup"),
        T("trainer_dedup@dedup", True, resume="trainer_dedup"),
        T("trainer_dedup2@dedup2", True, workers=2, resume="trainer_dedup2")]
    records = ar.run_arms(root, "continuous", continuous)
    records.update(ar.run_arms(root, "resumed", resumed))
    return root, records


def same_steps(expected, got, what):
    assert len(got) == len(expected), f"{what}: {len(got)} steps, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_same(e, g, f"{what}: step {i}")


def same_run(expected, got, what, keys):
    """Two runs, rank by rank: the step lists step by step, the rest as a whole."""
    for rank, (e, g) in enumerate(zip(expected, got)):
        for key in keys:
            if key.endswith("steps"):
                same_steps(e[key], g[key], f"{what}, rank {rank}, {key}")
            else:
                assert_same(e[key], g[key], f"{what}, rank {rank}: {key}")


LOOP_KEYS = ("steps", "len", "params", "rng")
TRAINER_KEYS = ("micro_steps", "optimizer_steps", "len", "params", "rng")


def only_leaders_load(arm, runs_of_arm):
    """The TP leaders read samples, the followers none - after prepare, where accelerate itself
    starts a StatefulDataLoader's workers on every rank (accelerate_ranks.py records how many they
    read there; spbcast ends them on the followers)."""
    import accelerate_ranks as ar

    def read(rank):
        return runs_of_arm[rank]["fetches"] - runs_of_arm[rank].get("fetches_in_prepare", 0)

    for rank in ar.LEADERS:
        assert read(rank) > 0, f"{arm}: TP leader {rank} read no sample"
    for rank in ar.FOLLOWERS:
        assert read(rank) == 0, f"{arm}: TP follower {rank} read {read(rank)} samples"


@pytest.mark.parametrize("arm", ["", "_noisy", "_stateful", "_cp"])
def test_accelerate_loop_equals_base(runs, arm):
    """Every rank's steps, len(), parameters and generator under dedup are BASE's (for the noisy
    data: the leaders', whose batches the followers get - see test_tp_peers_share_the_leaders_batch).
    "_cp": the (dp_shard 2, cp 2) mesh, whose CP pairs share a data index as TP pairs do; the CP
    pair's batches are the same in BASE too (deterministic data), so dedup changes nothing."""
    _, records = runs
    base, dedup = records[f"loop_base{arm}"], records[f"loop_dedup{arm}"]
    if arm == "_noisy":
        import accelerate_ranks as ar

        for leader in ar.LEADERS:
            same_run([base[leader]], [dedup[leader]], f"loop{arm}, leader {leader}", LOOP_KEYS)
        for follower in ar.FOLLOWERS:  # all but the batch: the model reads no noise
            def without_batch(record):
                return dict(record, steps=[dict(step, batch=None) for step in record["steps"]])
            same_run([without_batch(base[follower])], [without_batch(dedup[follower])],
                     f"loop{arm}, follower {follower}", LOOP_KEYS)
    else:
        same_run(base, dedup, f"loop{arm}", LOOP_KEYS)
    for rank, record in enumerate(base):
        assert not record["shared"] and record["fetches"] > 0, f"BASE rank {rank}"
    assert all(r["shared"] for r in dedup)
    only_leaders_load(f"loop_dedup{arm}", dedup)
    assert any(s["end"] for s in base[0]["steps"]) and any(not s["sync"] for s in base[0]["steps"])


def test_prefetch_where_exact(runs):
    """The leader fetches ahead by default with DataLoader workers (accelerate's samplers around
    torch's draw nothing from the default generator mid-pass), and not with num_workers=0."""
    _, records = runs
    assert [r["prefetch"] for r in records["loop_dedup_noisy"]] == [1] * 4
    assert [r["prefetch"] for r in records["loop_dedup_stateful"]] == [1] * 4
    assert [r["prefetch"] for r in records["loop_dedup"]] == [0] * 4
    assert [r["prefetch"] for r in records["loop_dedup_cp"]] == [1] * 4


def test_tp_peers_share_the_leaders_batch(runs):
    """Worker-side randomness, workers seeded by global rank (the Trainer's seed_worker): BASE gives
    the two ranks of a TP pair different batches; dedup gives both the leader's BASE batch."""
    import accelerate_ranks as ar

    _, records = runs
    for base_name, dedup_name, key, field in (("loop_base_noisy", "loop_dedup_noisy", "steps", "batch"),
                                              ("trainer_base_noisy", "trainer_dedup_noisy", "micro_steps",
                                               "inputs")):
        base, dedup = records[base_name], records[dedup_name]
        for leader, follower in zip(ar.LEADERS, ar.FOLLOWERS):
            base_pair = [(a[field], b[field]) for a, b in zip(base[leader][key], base[follower][key])]
            assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in base_pair), (
                f"{base_name}: the TP pair ({leader}, {follower}) got the same batches in BASE: the "
                "data has no per-rank randomness, so this test proves nothing")
            for step, (b, d) in enumerate(zip(base[leader][key], dedup[follower][key])):
                assert_same(b[field], d[field], f"{dedup_name}: follower {follower}, step {step}")
        only_leaders_load(dedup_name, dedup)


def test_trainer_equals_base(runs):
    """The real Trainer.train(), 0 and 2 workers: every rank's inputs, losses, grad norms, generator
    per step, len(), final parameters and generator are BASE's; followers read no sample."""
    _, records = runs
    for arm in ("", "2"):
        base, dedup = records[f"trainer_base{arm}"], records[f"trainer_dedup{arm}"]
        same_run(base, dedup, f"trainer{arm}", TRAINER_KEYS)
        assert all(r["fetches"] > 0 for r in base)
        only_leaders_load(f"trainer_dedup{arm}", dedup)
    assert len(records["trainer_base"][0]["optimizer_steps"]) == 6


def same_from_the_resume(continuous, resumed, what):
    """A resumed Trainer run, rank by rank: its micro-steps and optimizer steps are the continuous
    run's last ones, and it ends with the continuous run's parameters and generator."""
    for rank, (e, g) in enumerate(zip(continuous, resumed)):
        where = f"{what}, rank {rank}"
        n = len(g["micro_steps"])
        assert 0 < n < len(e["micro_steps"]), f"{where}: {n} micro-steps after the resume"
        same_steps(e["micro_steps"][-n:], g["micro_steps"], where + ", micro_steps")
        same_steps(e["optimizer_steps"][-len(g["optimizer_steps"]):], g["optimizer_steps"],
                   where + ", optimizer_steps")
        for key in ("params", "rng"):
            assert_same(e[key], g[key], f"{where}: {key}")


def test_trainer_resumes_across_the_switch(runs):
    """resume_from_checkpoint at the mid-epoch checkpoint, in new processes (the Trainer skips the
    epoch's first batches with accelerate's skip_first_batches): dedup from BASE's checkpoint,
    BASE from dedup's, dedup from its own, go on exactly as the continuous BASE run."""
    import accelerate_ranks as ar

    root, records = runs
    for resumed, continuous in (("trainer_dedup@base", "trainer_base"), ("trainer_base@dedup", "trainer_base"),
                                ("trainer_dedup@dedup", "trainer_base"), ("trainer_dedup2@dedup2", "trainer_base2")):
        same_from_the_resume(records[continuous], records[resumed], resumed)
        if resumed.startswith("trainer_dedup"):
            only_leaders_load(resumed, records[resumed])
    for rank in range(ar.WORLD):  # what each rank's checkpoint holds of its generators
        name = f"rng_state_{rank}.pth"
        assert_same(torch.load(os.path.join(ar.checkpoint(root, "trainer_base"), name), weights_only=False),
                    torch.load(os.path.join(ar.checkpoint(root, "trainer_dedup"), name), weights_only=False),
                    f"checkpoint {name}")


def test_stateful_loader_saved_and_loaded_across_the_switch(runs):
    """use_stateful_dataloader: accelerator.save_state after step 2, load_state in new processes.
    dedup's saved loader state is BASE's; dedup loading BASE's state, and BASE loading dedup's, go
    on as BASE loading its own."""
    root, records = runs
    reference = records["loop_base_stateful@base"]
    for resumed in ("loop_dedup_stateful@base", "loop_base_stateful@dedup"):
        same_run(reference, records[resumed], resumed, LOOP_KEYS)
    only_leaders_load("loop_dedup_stateful@base", records["loop_dedup_stateful@base"])
    saved = [torch.load(os.path.join(root, arm, "state", "dl_state_dict.bin"), weights_only=False)
             for arm in ("loop_base_stateful", "loop_dedup_stateful")]
    assert_same(saved[0], saved[1], "dl_state_dict.bin")
    assert 0 < len(reference[0]["steps"]) < len(records["loop_base_stateful"][0]["steps"])


def test_untouched_without_shared_data_index(runs):
    """No mesh: every rank has its own data index; the loader is accelerate's own and every rank reads."""
    _, records = runs
    for rank, record in enumerate(records["loop_no_mesh"]):
        assert not record["shared"] and record["fetches"] > 0, f"rank {rank}"


@pytest.mark.parametrize("arm, says", [
    ("loop_dispatch", "dispatch_batches=True"),
    ("loop_unknown_option", "'prefetch_depth'"),
])
def test_refusals_are_clear_on_every_rank(runs, arm, says):
    _, records = runs
    for rank, record in enumerate(records[arm]):
        assert record["error"] is not None, f"{arm}: rank {rank} raised nothing"
        assert record["error"].startswith(f"spbcast: rank {rank} (spbcast.accelerate): "), record["error"]
        assert says in record["error"], record["error"]
