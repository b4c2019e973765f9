"""LeaderLoader's prefetch on real Gloo ranks: batches arrive while the trainer steps (and uses
the SP group itself), a failure of a prefetched step is raised at that step on every rank and the
data after it still comes, the end of the data is not lost, and closing mid-epoch, a hung or
dead leader, a fork while a fetch is in flight and an exit without close() end without a hang
or a thread left. (Exactness with prefetch on is test_loader.py's DataLoader matrix, resuming
its restart test, torchdata's test_stateful_dataloader.py, XTuner's test_xtuner_trainer.py.)"""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import spbcast
from dist_harness import run

STEPS = 8  # 16 samples, batches of 2


class Numbers(Dataset):
    """Sample i is {"x": [i, i]}; sample `bad` raises ValueError, sample `odd` carries a value
    spbcast does not send (a sparse tensor), and every read takes `delay` seconds."""

    def __init__(self, bad=-1, odd=-1, delay=0.0):
        self.bad, self.odd, self.delay = bad, odd, delay

    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(self.delay)
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        return {"x": torch.full((2,), i), "odd": torch.ones(2).to_sparse() if i == self.odd else None}


def _collate(items):
    odd = [it["odd"] for it in items if it["odd"] is not None]
    return {"x": torch.stack([it["x"] for it in items]), "odd": odd[0] if odd else None}


def _loader(workers=2, **dataset):
    return lambda: DataLoader(Numbers(**dataset), batch_size=2, num_workers=workers,
                              collate_fn=_collate,
                              multiprocessing_context="fork" if workers else None)


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("spbcast prefetch")]


def _steps_and_errors(rank, world):
    # Sample 7 (step 4) raises in its worker; sample 10 (step 6) is a batch spbcast refuses.
    ll = spbcast.LeaderLoader(_loader(bad=7, odd=10), None, sp_media_dedup=True, total_epoch=1)
    assert ll.stats()["prefetch"] == 1, ll.stats()
    it, seen = iter(ll), []
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except spbcast.Error as e:
            seen.append((ll.step, e.code))
            continue
        seen.append((ll.step, batch["x"][:, 0].tolist()))
        total = torch.ones(1)
        dist.all_reduce(total)  # the trainer's own collective on the SP group, every step
        time.sleep(0.05)  # the step: the next batch is fetched and sent meanwhile
    # Step 4's fetch raised (no step taken: the DataLoader moved on to the next batch), step 6
    # was refused after its batch was produced (a step); nothing earlier, nothing lost.
    assert seen == [(1, [0, 1]), (2, [2, 3]), (3, [4, 5]), (3, "loader"), (4, [8, 9]),
                    (5, "unsupported_value"), (6, [12, 13]), (7, [14, 15])], seen
    stats = ll.stats()
    assert stats["steps"] == 6 and stats["prefetch_hits"] >= 1, stats
    ll.close()
    assert not _prefetch_threads()


def test_errors_at_their_step_and_nothing_lost():
    run(2, _steps_and_errors, timeout=120)


def _close_mid_epoch(rank, world, dead_leader):
    ll = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=2)
    it = iter(ll)
    for _ in range(3):
        next(it)
    assert _prefetch_threads() and ll.stats()["prefetch"] == 1
    if dead_leader and rank == 0:
        os._exit(0)  # the leader dies with a step in flight and another wanted
    if dead_leader:
        started = time.monotonic()
        with pytest.raises(spbcast.Error):
            while True:
                next(it)
        assert time.monotonic() - started < 20
        os._exit(0)  # its group lost a rank: nothing more to check in this process
    ll.close()  # on every rank, with a step in flight
    assert not _prefetch_threads()
    dist.barrier()  # the ranks are in step on the default group
    # A new loader on the same ranks makes a channel of its own (named alike on every rank).
    again = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=1)
    assert [b["x"][0, 0].item() for b in again] == list(range(0, 16, 2))
    again.close()


@pytest.mark.parametrize("dead_leader", [False, True], ids=["close", "dead leader"])
def test_close_mid_epoch(dead_leader):
    run(2, _close_mid_epoch, dead_leader, timeout=120)


def _hung_leader(rank, world):
    ll = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=1, timeout=1,
                              root_wait=3)
    it = iter(ll)
    next(it)
    if rank == 0:
        time.sleep(8)  # hung outside the loader, longer than root_wait
        ll.close()  # no hang either: the followers are gone from the channel
        return
    started = time.monotonic()
    with pytest.raises(spbcast.TransportError, match="root_wait|sent nothing|timeout|timed out"):
        for _ in range(STEPS):
            next(it)
    waited = time.monotonic() - started
    assert 1 < waited < 12, waited
    ll.close()


def test_hung_leader_fails_followers_within_root_wait():
    run(2, _hung_leader, timeout=120)


def _fork_while_fetching(rank, world):
    ll = spbcast.LeaderLoader(_loader(delay=0.1), None, sp_media_dedup=True, total_epoch=1)
    it = iter(ll)
    next(it)  # the leader's prefetch thread now fetches the next batch
    pid = os.fork()
    if pid == 0:  # a child of a process whose prefetch thread is busy: no lock of it held here
        code = 1
        try:
            with spbcast.shared_memory():
                torch.ones(1 << 20).sum()
            spbcast.shared_memory_statistics()
            ll.stats()
            ll.close()  # the parent's thread, channel and DataLoader workers are not touched
            code = 0
        finally:
            os._exit(code)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(list(it)) == STEPS - 1  # the parent's loop goes on
    ll.close()


def test_fork_while_a_fetch_is_in_flight():
    run(2, _fork_while_fetching, timeout=120)


def _exit_without_close(rank, world):
    ll = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=1)
    it = iter(ll)
    next(it)
    next(it)
    # Returns mid-epoch with a step in flight: the harness destroys the process group and the
    # interpreter exits (closing the loader at exit), within the harness's timeout.


def test_exit_mid_epoch_without_close():
    run(2, _exit_without_close, timeout=60)


def _synchronous_where_not_exact(rank, world):
    in_process = spbcast.LeaderLoader(_loader(workers=0), None, sp_media_dedup=True, total_epoch=1)
    assert in_process.stats()["prefetch"] == 0
    assert "num_workers=0" in in_process.stats()["prefetch_reason"]
    forced = spbcast.LeaderLoader(_loader(workers=0), None, sp_media_dedup=True, total_epoch=1,
                                  prefetch=2)
    off = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=1, prefetch=0)
    assert forced.stats()["prefetch"] == 2 and off.stats()["prefetch"] == 0
    assert [b["x"].tolist() for b in forced] == [b["x"].tolist() for b in off] \
        == [b["x"].tolist() for b in in_process]
    forced.close()
    assert "prefetch 2" in forced._summary()
    with pytest.raises(spbcast.Error, match="prefetch must be"):
        spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, total_epoch=1, prefetch=-1)


def test_depth_and_when_it_is_off():
    run(2, _synchronous_where_not_exact, timeout=120)


def _new_pass_mid_pass(rank, world):
    # A trainer that drives the passes and leaves one early: the next iter() starts a new pass
    # on every rank, the batches prefetched for the old one dropped alike.
    ll = spbcast.LeaderLoader(_loader(), None, sp_media_dedup=True, set_epoch=None)
    first = iter(ll)
    assert [next(first)["x"][0, 0].item() for _ in range(3)] == [0, 2, 4]
    assert [b["x"][0, 0].item() for b in ll] == list(range(0, 16, 2))
    assert [b["x"][0, 0].item() for b in ll] == list(range(0, 16, 2))
    ll.close()


def test_new_pass_while_batches_are_prefetched():
    run(2, _new_pass_mid_pass, timeout=120)
