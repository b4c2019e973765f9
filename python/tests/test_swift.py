"""spbcast.swift proven against the real ms-swift (the version scripts/setup.sh pins in its own
environment): 4 Gloo ranks on CPU, sequence_parallel_size 2 (SP groups (0, 1) and (2, 3), data
ranks 0 and 1), through ms-swift's own ``swift sft`` pipeline - a tiny Qwen2-VL built from a
config, image-and-text samples that ms-swift's LazyLLMDataset encodes with the Qwen2-VL template
(qwen_vl_utils' image fetch, the image processor) - BASE (ms-swift as shipped: every SP rank
encodes) against dedup (``spbcast.swift.enable()``: only the SP leaders, ranks 0 and 2, encode).

The trainer's own train loader, two epochs as the Trainer drives them (set_epoch), then ms-swift's
resume path (skip_first_batches -> get_train_dataloader(skip_batches=2)): every rank's batches
bit for bit, len(), its default CPU generator after each pass - with 0 and 2 DataLoader workers
(prefetch on) - and the encodes counted in every process (workers included). The real
``trainer.train()`` through ms-swift's SP trainer (Ulysses over SDPA, on CPU): every rank's inputs
per step, losses, final parameters and generator; the checkpoint's files; resumed from the
mid-run checkpoint in new processes, BASE and dedup checkpoints either way; with 0 and 2 workers. Refusals are one clear
error on every rank. An SP leader killed in training is named by its follower within a second
(peer_death.py).

The ranks are forked from this process, which imports ms-swift once (swift_ranks.py)."""

import os

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (scripts/setup.sh installs ms-swift==4.6.0 into "
                    "its own environment, $HOME/.cache/spbcast/venv-swift; scripts/test.sh runs this test there)")
import importlib.util  # noqa: E402

import torch  # noqa: E402

if importlib.util.find_spec("qwen_vl_utils") is None:  # not imported here: it needs torchvision (swift_ranks.py)
    pytest.skip("qwen-vl-utils is not installed (scripts/setup.sh installs it with ms-swift)", allow_module_level=True)

from batches import assert_same  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import swift_ranks as sr

    root = str(tmp_path_factory.mktemp("swift"))
    A = sr.Arm
    continuous = [
        A("loader_base", False), A("loader_base_workers", False, workers=2),
        A("train_base", False, kind="train"), A("train_base_workers", False, kind="train", workers=2),
        A("loader_dedup", True, plugin=True),  # the first dedup arm: nothing but the plugin enables it
        A("loader_dedup_workers", True, workers=2),
        A("train_dedup", True, kind="train"), A("train_dedup_workers", True, kind="train", workers=2),
        A("streaming", True, streaming=True, expect_error=True),
        A("unknown_option", True, options={"prefetch_depth": 1}, expect_error=True)]
    resumed = [  # new processes; "a@b": a resumed from b's checkpoint after step 2 of 4
        A("train_base@base", False, kind="train", resume=sr.checkpoint("", "train_base")),
        A("train_base@dedup", False, kind="train", resume=sr.checkpoint("", "train_dedup")),
        A("train_base_workers@base", False, kind="train", workers=2, resume=sr.checkpoint("", "train_base_workers")),
        A("train_dedup@base", True, kind="train", resume=sr.checkpoint("", "train_base")),
        A("train_dedup@dedup", True, kind="train", resume=sr.checkpoint("", "train_dedup")),
        A("train_dedup_workers@dedup", True, kind="train", workers=2, resume=sr.checkpoint("", "train_dedup_workers"))]
    records = sr.run_arms(root, "continuous", continuous)
    records.update(sr.run_arms(root, "resumed", resumed))
    return root, records


def only_leaders_encode(arm, records, workers=False):
    import swift_ranks as sr
    from calls_counted import assert_only_leaders

    assert_only_leaders(arm, records, sr.LEADERS, sr.FOLLOWERS, "encodes", "encoded", workers)


@pytest.mark.parametrize("workers", ["", "_workers"])
def test_train_loader_equals_base(runs, workers):
    """The trainer's train loader: len(), both epochs' batches and every rank's generator after each
    pass, and ms-swift's resume loader (skip_batches) the same, bit for bit, on every rank."""
    _, records = runs
    base, dedup = records[f"loader_base{workers}"], records[f"loader_dedup{workers}"]
    for rank, (b, d) in enumerate(zip(base, dedup)):
        where = f"loader{workers}, rank {rank}"
        assert b["len"] == d["len"] == 7, where  # 13 samples, 2 data ranks: rounded up to 14
        for epoch, (be, de) in enumerate(zip(b["epochs"], d["epochs"])):
            assert len(be["batches"]) == 7, where
            assert be["batches"] == de["batches"], f"{where}: epoch {epoch}'s batches"
            assert torch.equal(be["rng"], de["rng"]), f"{where}: the generator after epoch {epoch}"
        assert b["skipped"]["len"] == d["skipped"]["len"] == 5, where
        assert b["skipped"]["batches"] == d["skipped"]["batches"], f"{where}: the resume loader's batches"
        assert torch.equal(b["skipped"]["rng"], d["skipped"]["rng"]), f"{where}: the generator after resume"
        assert b["encodes"] == 19, where  # BASE: every rank encodes every sample it trains on
    for leader, follower in ((0, 1), (2, 3)):  # BASE: the ranks of an SP group get the same batches
        assert [e["batches"] for e in base[leader]["epochs"]] == [e["batches"] for e in base[follower]["epochs"]]
    assert base[0]["epochs"][0]["batches"] != base[2]["epochs"][0]["batches"]  # data ranks differ
    for b in base:  # ms-swift's order, kept: the Trainer's set_epoch reaches the sampler of the loader
        assert b["epochs"][0]["batches"] != b["epochs"][1]["batches"]
        # ... and not the resume loader's (accelerate's SkipBatchSampler has no set_epoch): epoch 1
        # resumed replays epoch 0's order
        assert b["skipped"]["batches"] == b["epochs"][0]["batches"][2:]
    only_leaders_encode(f"loader_dedup{workers}", dedup, workers=bool(workers))


def test_cli_plugin_enables(runs):
    """``--external_plugins "$(python -m spbcast.swift)"``, the first dedup arm of its processes:
    the plugin alone turned dedup on, on every rank."""
    _, records = runs
    assert all(r["stats"] is not None for r in records["loader_dedup"])
    assert all(r["stats"] is None for r in records["loader_base"])


def test_prefetch_where_exact(runs):
    """The leader fetches ahead with DataLoader workers (SequenceParallelSampler draws from its own
    generator), not with num_workers=0 (the template encodes on the trainer's process)."""
    _, records = runs
    assert [r["stats"]["prefetch"] for r in records["loader_dedup_workers"]] == [1] * 4
    assert [r["stats"]["prefetch"] for r in records["loader_dedup"]] == [0] * 4
    assert all(r["stats"]["steps"] == 14 for r in records["loader_dedup"])


def same_training(expected, got, where, steps=None):
    """Two training runs on one rank: inputs per step (the last ``steps``), losses, parameters, generator."""
    n = len(got["inputs"]) if steps is None else steps
    assert 0 < n <= len(expected["inputs"]) and len(got["inputs"]) == n, f"{where}: {len(got['inputs'])} steps"
    assert expected["inputs"][-n:] == got["inputs"], f"{where}: the inputs"
    assert expected["losses"][-n:] == got["losses"][-n:], f"{where}: the losses"
    assert_same(expected["parameters"], got["parameters"], f"{where}: the parameters")
    assert torch.equal(expected["rng"], got["rng"]), f"{where}: the generator"


@pytest.mark.parametrize("workers", ["", "_workers"])
def test_sp_training_equals_base(runs, workers):
    """ms-swift's SP trainer on CPU (Ulysses over SDPA), 4 steps, 0 and 2 DataLoader workers (prefetch
    on): every rank's inputs, losses, final parameters and generator are BASE's; the followers
    encode nothing."""
    _, records = runs
    base, dedup = records[f"train_base{workers}"], records[f"train_dedup{workers}"]
    for rank, (b, d) in enumerate(zip(base, dedup)):
        same_training(b, d, f"train{workers}, rank {rank}")
        assert len(b["losses"]) == 4
    only_leaders_encode(f"train_dedup{workers}", dedup, workers=bool(workers))
    if workers:
        assert [r["stats"]["prefetch"] for r in dedup] == [1] * 4


def test_checkpoints_unchanged(runs):
    """What dedup's checkpoint holds - each rank's generators, the model, the optimizer - is BASE's."""
    import swift_ranks as sr

    root, _ = runs
    names = [f"rng_state_{rank}.pth" for rank in range(sr.WORLD)] + ["optimizer.pt", "scheduler.pt"]
    for name in names:
        assert_same(torch.load(os.path.join(sr.checkpoint(root, "train_base"), name), weights_only=False),
                    torch.load(os.path.join(sr.checkpoint(root, "train_dedup"), name), weights_only=False),
                    f"checkpoint {name}")
    with open(os.path.join(sr.checkpoint(root, "train_base"), "model.safetensors"), "rb") as b, \
            open(os.path.join(sr.checkpoint(root, "train_dedup"), "model.safetensors"), "rb") as d:
        assert b.read() == d.read(), "model.safetensors"


def test_resume_across_the_switch(runs):
    """resume_from_checkpoint after step 2 of 4, in new processes (ms-swift rebuilds the loader with
    get_train_dataloader(skip_batches=2)): dedup from BASE's checkpoint, BASE from dedup's, dedup
    from its own, go on exactly as BASE from BASE's."""
    _, records = runs
    reference = records["train_base@base"]
    for arm in ("train_base@dedup", "train_dedup@base", "train_dedup@dedup"):
        for rank, (e, g) in enumerate(zip(reference, records[arm])):
            same_training(e, g, f"{arm}, rank {rank}", steps=2)
    only_leaders_encode("train_dedup@base", records["train_dedup@base"])
    # With workers (prefetch on): dedup from its own checkpoint goes on as BASE from BASE's.
    for rank, (e, g) in enumerate(zip(records["train_base_workers@base"], records["train_dedup_workers@dedup"])):
        same_training(e, g, f"train_dedup_workers@dedup, rank {rank}", steps=2)
    only_leaders_encode("train_dedup_workers@dedup", records["train_dedup_workers@dedup"], workers=True)


@pytest.mark.parametrize("arm, says", [
    ("streaming", "streaming sequence parallelism"),
    ("unknown_option", "'prefetch_depth'"),
])
def test_refusals_are_clear_on_every_rank(runs, arm, says):
    from dist_harness import assert_refused_on_every_rank

    assert_refused_on_every_rank(runs[1][arm], "spbcast.swift", says)


def test_import_spbcast_does_not_import_swift():
    import subprocess
    import sys

    code = "import sys, spbcast, spbcast.swift; assert 'swift' not in sys.modules, 'imported ms-swift'; " \
           "print(spbcast.swift.plugin_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith(os.path.join("spbcast", "plugins", "spbcast_swift_plugin.py"))
    path = subprocess.run([sys.executable, "-m", "spbcast.swift"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.isfile(path) and "spbcast.swift.enable()" in open(path).read()
    assert os.listdir(os.path.dirname(path)) in (["spbcast_swift_plugin.py"], ["spbcast_swift_plugin.py", "__pycache__"],
                                                 ["__pycache__", "spbcast_swift_plugin.py"]), \
        "ms-swift puts the plugin's folder on sys.path: nothing else may be importable from it"


def test_megatron_swift_refused():
    """Megatron-SWIFT parses its arguments - and imports the plugin - with swift.megatron loaded
    (which needs megatron-core: here a stand-in module): enable() refuses, naming the rank."""
    import subprocess
    import sys

    code = ("import sys, types; sys.modules['swift.megatron'] = types.ModuleType('swift.megatron')\n"
            "import spbcast.swift\n"
            "try:\n    spbcast.swift.enable()\nexcept spbcast.Error as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("spbcast: rank 0 (spbcast.swift): Megatron-SWIFT"), out


@pytest.mark.parametrize("workers", [2, 0])
def test_a_dead_sp_leader_is_named_within_a_second(tmp_path, workers):
    """ms-swift's SP training under spbcast.swift.enable(), 2 DataLoader workers (which would keep
    the leader's sockets) or none: the SP leader rank 0 is SIGKILLed while it waits for its next
    batch. Its follower rank 1 raises spbcast's error naming it within 1 s and exits within 1 s;
    ranks 2 and 3 (the other SP pair) fail in the gradients' all-reduce, the backend's error -
    they only have to end; nothing of the job is left (docs/errors.md)."""
    import functools

    import peer_death
    import swift_ranks as sr

    sr.prepare(str(tmp_path))
    victim, records, ended, ranks = peer_death.fork(functools.partial(sr.leader_dies, str(tmp_path), workers),
                                                    sr.WORLD)
    assert victim["pid"] == ranks[0].pid
    peer_death.assert_named(1, records[1], ended, victim, 0, f"ms-swift, {workers} workers")
    for r in (2, 3):
        assert records[r]["error"] is not None, f"rank {r} finished training without its DP peer"
