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
