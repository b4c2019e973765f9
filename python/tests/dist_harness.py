"""Runs a function on N real Gloo ranks (spawned processes on 127.0.0.1).

The ranks meet through a FileStore in a fresh temporary file, so no TCP port is chosen (and
none can race with another test run). Each rank runs fn(rank, world, *args); an exception on
any rank fails the test with that rank's traceback.
"""

import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args, prepare):
    torch.set_num_threads(1)
    if prepare is not None:
        prepare(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    wait_for_every_rank(init_file + ".set-up", world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def wait_for_every_rank(path, world, timeout=60):
    """Returns once every rank of the job called it (a FileStore at ``path``, not a collective:
    it works whatever the group's backends). Called right after init_process_group, it keeps
    the invariant that every rank's group is set up before any rank runs a case: a rank that
    fails at once (a bad configuration, raised before any collective) must not tear its group
    down while another is still connecting to it - that one would fail with "Connection closed
    by peer", on a busy machine."""
    store = dist.FileStore(path, world)
    store.add("set-up", 1)
    end = time.monotonic() + timeout
    while store.add("set-up", 0) < world:
        if time.monotonic() > end:
            raise TimeoutError(f"not every rank set up its group within {timeout} s")
        time.sleep(0.01)


def run(world, fn, *args, timeout=120, prepare=None, start_method="spawn"):
    """prepare: a picklable callable run as prepare(rank) in each rank before it joins the group
    (test_hosts.py moves each rank into its "host" there). start_method "fork": the ranks start
    with what this process imported (a test that imported a trainer's heavy modules once)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world, init_file, fn, args, prepare), nprocs=world,
                                 join=False, start_method=start_method)
        end = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, end - time.monotonic())):
                if time.monotonic() > end:
                    raise TimeoutError(f"ranks still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


def run_arms(world, run_arm, root, tag, arms, timeout=170, prepare=None, seed=1234):
    """Forks one job of ``world`` ranks from this process (they start with the trainer's modules it
    imported) whose ranks each run ``run_arm(arm, rank, root)`` -> a record for every arm of
    ``arms`` in turn, a barrier after each; returns {arm name: [its record per rank]}. The BASE
    arms run before the dedup arms (``arm.dedup``): a trainer's ``enable()`` is process-wide."""
    dedup = [arm.dedup for arm in arms]
    assert dedup == sorted(dedup), "the BASE arms run before the dedup arms: enable() is process-wide"
    run(world, _arms_rank, run_arm, root, tag, arms, seed, timeout=timeout, prepare=prepare, start_method="fork")
    per_rank = [torch.load(os.path.join(root, f"records-{tag}-rank{r}.pt"), weights_only=False)
                for r in range(world)]
    return {arm.name: [records[arm.name] for records in per_rank] for arm in arms}


def _arms_rank(rank, world, run_arm, root, tag, arms, seed):
    torch.manual_seed(seed)  # every rank alike, before the first arm
    records = {}
    for arm in arms:
        records[arm.name] = run_arm(arm, rank, root)
        dist.barrier()
    torch.save(records, os.path.join(root, f"records-{tag}-rank{rank}.pt"))


def assert_refused_on_every_rank(records, where, says):
    """Every rank's record (run_arms') holds an error that names the rank and ``where`` (a module:
    "spbcast: rank N (where): ") and says ``says``."""
    for rank, record in enumerate(records):
        assert record["error"] is not None, f"rank {rank} raised nothing"
        assert f"spbcast: rank {rank} ({where}): " in record["error"], record["error"]
        assert says in record["error"], record["error"]
