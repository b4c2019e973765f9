"""spbcast.energon proven against Megatron-Energon's real code (the version scripts/setup.sh pins):
a captioning WebDataset of 4 tar shards made with Energon's own ``energon prepare``, 4 Gloo ranks
at DP 2 x TP 2, Energon's ``get_train_dataset`` with ``WorkerConfig(rank=dp_rank, world_size=2,
num_workers=2 or 0, data_parallel_group=...)`` and a task encoder that flips images at random
(seeded by Energon, in its workers).

Energon's own ``get_savable_loader`` on every rank (BASE) against
``spbcast.energon.get_savable_loader(..., group=tp_group)`` (dedup), per rank and step, bit for
bit: the batch (Energon's CaptioningSample: image tensor, captions, __key__, __restore_key__,
__subflavors__, __sources__) and ``torch.get_rng_state()``. Only the TP leaders' task encoders
encode; dedup followers may pass no dataset at all. Energon's states saved after step 3
(``save_state_rank``, ``save_state_global``) resume in new processes - dedup from dedup's (each
rank what it saved: None on followers), BASE from dedup's and dedup from BASE's (every rank the
state its DP rank's first rank saved, as Megatron-Bridge does), and through
``restore_state_global`` - to the continuous run's batches. A batch holding a class nobody
allowed (a user's, or one of Energon's that is no batch class) is refused on every rank, as is a
state Energon cannot restore and a group that is the DP group. A TP leader killed in Energon's
loop is named by its follower within a second (peer_death.py). Skipped, saying why, where
megatron.energon is not importable."""

import dataclasses
import functools
import importlib.util
import os

import pytest
import torch

import peer_death
from batches import assert_same



def _energon_missing():
    try:
        return importlib.util.find_spec("megatron.energon") is None
    except ModuleNotFoundError:  # no megatron package at all
        return True


if _energon_missing():
    pytest.skip("megatron-energon is not installed here; ./scripts/setup.sh installs "
                "megatron-energon==7.4.1 into the main environment", allow_module_level=True)

import energon_ranks as er  # noqa: E402 - imports megatron.energon
from megatron.energon.epathlib import EPath  # noqa: E402


def comparable(value):
    """A batch or state as plain values for assert_same: dataclasses as (class, {field: value}),
    an EPath (it keeps a storage client) as what it pickles; tensors, numpy arrays and scalars
    as they are."""
    if isinstance(value, EPath):
        return ("EPath", value.__getstate__()["profile"], str(value.__getstate__()["internal_path"]))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (f"{type(value).__module__}.{type(value).__qualname__}",
                {f.name: comparable(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v) for v in value)
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    return value


def same_steps(expected, got, what, rng=True):
    assert len(got["steps"]) == len(expected["steps"]), f"{what}: {len(got['steps'])} steps"
    for i, (e, g) in enumerate(zip(expected["steps"], got["steps"])):
        assert_same(comparable(e), comparable(g), f"{what}: step {i + 1}")
    if rng:
        for i, (e, g) in enumerate(zip(expected["rng"], got["rng"])):
            assert torch.equal(e, g), f"{what}: the default generator after step {i + 1} differs"


def no_errors(run, what):
    for rank, record in enumerate(run):
        assert record["error"] is None, f"{what}, rank {rank}: {record['error']}"


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory):
    """A directory holding the prepared dataset, in data/."""
    root = str(tmp_path_factory.mktemp("energon"))
    os.makedirs(os.path.join(root, "data"))
    er.write_dataset(os.path.join(root, "data"))
    return root


@pytest.fixture(scope="module")
def runs(dataset_root):
    root = dataset_root
    Arm = er.Arm
    continuous = [Arm("base2", False), Arm("dedup2", True), Arm("base0", False, workers=0),
                  Arm("dedup0", True, workers=0, followers_build=False),
                  Arm("unknown", True, workers=0, encoder="unknown"),
                  Arm("hostile", True, workers=0, encoder="hostile"),
                  Arm("wrong_group", True, workers=0, wrong_group=True)]
    resumed = [Arm("dedup2@dedup2", True, resume=("dedup2", "rank")),
               Arm("base2@dedup2", False, resume=("dedup2", "dprank")),  # the switch turned off
               Arm("dedup2@base2", True, resume=("base2", "dprank")),  # and on
               Arm("dedup2@dedup2-global", True, resume=("dedup2", "global")),
               # A state Energon cannot restore: another micro batch size without workers.
               Arm("misfit", True, workers=0, batch_size=1, resume=("dedup0", "rank"))]
    records = {}
    for tag, arms in (("continuous", continuous), ("resumed", resumed)):  # new processes each
        per_rank = er.launch(root, tag, arms)
        records.update({arm.name: [r[arm.name] for r in per_rank] for arm in arms})
    return records


@pytest.mark.parametrize("workers", [2, 0])
def test_dedup_equals_base(runs, workers):
    base, dedup = runs[f"base{workers}"], runs[f"dedup{workers}"]
    no_errors(base, "BASE")
    no_errors(dedup, "dedup")
    for rank in range(er.WORLD):
        same_steps(base[rank], dedup[rank], f"{workers} workers, rank {rank}: BASE against dedup")
        assert dedup[rank]["len"] == base[rank]["len"] > er.STEPS, "len(): Energon's batches per rank"
    # What the comparison stands on: the two DP ranks read different data, and each rank's
    # generator is its own (seeded per rank), so a follower had to advance its own.
    assert comparable(base[0]["steps"][0]) != comparable(base[2]["steps"][0])
    assert not torch.equal(base[0]["rng"][-1], base[1]["rng"][-1])
    for rank in range(er.WORLD):  # the DataLoader's base seed, drawn at the first next()
        assert not torch.equal(base[rank]["rng_start"], base[rank]["rng"][0]), f"rank {rank}"


def test_only_leaders_encode(runs):
    for rank in range(er.WORLD):
        assert runs["base2"][rank]["encoded"] > 0, f"BASE: rank {rank} encoded nothing"
    for workers in (2, 0):
        dedup = runs[f"dedup{workers}"]
        for rank in er.LEADERS:
            assert dedup[rank]["encoded"] >= er.STEPS * er.BATCH, f"dedup: leader {rank}"
        for rank in er.FOLLOWERS:
            assert dedup[rank]["encoded"] == 0, (
                f"dedup, {workers} workers: follower {rank}'s task encoder encoded "
                f"{dedup[rank]['encoded']} samples")


def test_prefetch_where_exact(runs):
    assert [r["prefetch"] for r in runs["dedup2"]] == [1] * er.WORLD
    assert [r["prefetch"] for r in runs["dedup0"]] == [0] * er.WORLD


def test_state_is_energons(runs):
    """The leader's save_state_rank() after step 3 is BASE's, with a batch prefetched; followers'
    is None. save_state_global gathers the leaders' states to rank 0."""
    base, dedup = runs["base2"], runs["dedup2"]
    for rank in er.LEADERS:
        assert type(dedup[rank]["state"]).__name__ == "SavableDataLoaderState"
        assert_same(comparable(base[rank]["state"]), comparable(dedup[rank]["state"]),
                    f"rank {rank}: the state after step {er.SAVE_AT}")
    for rank in er.FOLLOWERS:
        assert dedup[rank]["state"] is None and dedup[rank]["global_state"] is None
    assert_same(comparable(base[0]["global_state"]), comparable(dedup[0]["global_state"]),
                "save_state_global on rank 0")
    assert dedup[2]["global_state"] is None  # not the gather's destination


@pytest.mark.parametrize("arm,base_resumed", [
    ("dedup2@dedup2", "base2@dedup2"), ("base2@dedup2", None), ("dedup2@base2", "base2@dedup2"),
    ("dedup2@dedup2-global", "base2@dedup2")])
def test_resumed(runs, arm, base_resumed):
    """Resumed in new processes from the state saved after step 3: the continuous run's batches
    from step 4 on, and each rank's generator where BASE resumed the same way has it."""
    resumed = runs[arm]
    no_errors(resumed, arm)
    for rank in range(er.WORLD):
        continuous = dict(runs["base2"][rank], steps=runs["base2"][rank]["steps"][er.SAVE_AT:])
        same_steps(continuous, resumed[rank], f"{arm}, rank {rank}: against the continuous run", rng=False)
        if base_resumed is not None:
            same_steps(runs[base_resumed][rank], resumed[rank], f"{arm}, rank {rank}: against {base_resumed}")
    if arm.startswith("dedup"):
        assert [r["encoded"] for r in resumed][1::2] == [0, 0], "followers encoded samples"


def errors(run, what):
    found = []
    for rank, record in enumerate(run):
        error = record["error"]
        assert error is not None, f"{what}: rank {rank} raised nothing"
        assert error["message"].startswith(f"spbcast: rank {rank} "), error["message"]
        found.append(error)
    return found


@pytest.mark.parametrize("arm,name", [("unknown", "energon_ranks.UnknownBatch"),
                                      ("hostile", "megatron.energon.worker.WorkerConfig")])
def test_class_nobody_allowed_is_refused(runs, arm, name):
    for error in errors(runs[arm], arm):
        assert error["code"] == "unsupported_value", error
        assert name in error["message"] and "allow_classes" in error["message"], error["message"]


def test_state_energon_cannot_restore(runs):
    """Energon's own AssertionError, raised on every rank of the group as in BASE."""
    for error in errors(runs["misfit"], "misfit"):
        assert "LoaderError" in error["mro"] and "AssertionError" in error["mro"], error["mro"]
        assert "Changing micro batch size is not allowed without workers" in error["message"]


def test_group_that_is_not_one_data_index(runs):
    for error in errors(runs["wrong_group"], "wrong_group"):
        assert error["code"] == "invalid_argument", error
        assert "not the data-parallel group" in error["message"], error["message"]


@pytest.mark.parametrize("workers", [2, 0])
def test_a_dead_tp_leader_is_named_within_a_second(dataset_root, workers):
    """The TP leader rank 0 SIGKILLs itself between steps of Energon's loop (dedup, 2 Energon
    workers, which would keep its sockets, or none): its follower rank 1 raises spbcast's error
    naming it within 1 s and exits within 1 s; the other TP pair (ranks 2, 3) finishes its
    steps; nothing of the job is left (docs/errors.md)."""
    victim, records, ended, ranks = peer_death.fork(functools.partial(er.leader_dies, dataset_root, workers),
                                                    er.WORLD)
    assert victim["pid"] == ranks[0].pid
    peer_death.assert_named(1, records[1], ended, victim, 0, f"Energon, {workers} workers")
    for r in (2, 3):
        assert records[r]["error"] is None, f"rank {r}, of the other TP group: {records[r]['error']}"
    assert all(code == 0 for _, code in ended.values()), ended
