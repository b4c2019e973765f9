"""Errors raised from Python name global ranks, as src= and the rest of the package do, on an
SP group whose ranks are not 0..n-1 (the second of two SP groups of two, global ranks [2, 3]):
LeaderLoader's own errors (a factory or a fetch failing on the leader, a bad state), a value
the root refuses, and the core's own transport errors, which it words in the ranks of the group
it is given."""

import re

import pytest
import torch
import torch.distributed as dist

import spbcast
from dist_harness import run


class Failing:
    def __init__(self, fail_at):
        self.fail_at = fail_at

    def __iter__(self):
        for i in range(4):
            if i == self.fail_at:
                raise OSError("disk on fire")
            yield torch.full((2,), i)


def _ranks(rank, world):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sp, leader = groups[rank // 2], rank // 2 * 2
    me = f"spbcast: rank {rank} (LeaderLoader, SP rank {rank % 2})"

    with pytest.raises(spbcast.Error) as info:
        spbcast.LeaderLoader(lambda: 1 / 0, sp, sp_media_dedup=True, total_epoch=1)
    assert str(info.value).startswith(f"{me}: the SP leader (rank {leader}) failed building the data "
                                      "loader: ZeroDivisionError"), str(info.value)
    assert info.value.code == "loader"

    ll = spbcast.LeaderLoader(lambda: Failing(2), sp, sp_media_dedup=True, total_epoch=1)
    it = iter(ll)
    assert [next(it).tolist() for _ in range(2)] == [[0, 0], [1, 1]]
    with pytest.raises(spbcast.Error) as info:
        next(it)
    assert str(info.value) == (f"{me}: the SP leader (rank {leader}) failed fetching step 3: "
                               "OSError: disk on fire"), str(info.value)
    # A state the leader cannot load: its own words there, the leader named on the followers.
    with pytest.raises(spbcast.Error) as info:
        ll.load_state_dict({"version": -1} if rank == leader else None)
    said = f"{me}: " if rank == leader else f"{me}: the SP leader (rank {leader}) failed loading its state: spbcast: rank {leader} "
    assert str(info.value).startswith(said) and "load_state_dict got a state" in str(info.value), str(info.value)
    assert info.value.code == "invalid_argument"

    # A value the root refuses: the root names itself, the followers the root and themselves.
    with pytest.raises(spbcast.Error) as info:
        spbcast.broadcast({"f": len} if rank == leader else None, sp, leader)
    if rank == leader:
        assert str(info.value).startswith(f"spbcast: rank {rank}: cannot send batch[\"f\"]")
    else:
        assert isinstance(info.value, spbcast.RemoteError) and info.value.root_rank == leader
        assert str(info.value).startswith(f"spbcast: rank {rank}: the root (rank {leader}) failed")
        assert info.value.root_message.startswith(f"spbcast: rank {leader}: cannot send")

    # The core's own words: a follower whose root never comes times out naming its own global
    # rank and the root's (the core says "rank 1 ... from root 0" on global rank 3).
    if rank != leader:
        with pytest.raises(spbcast.TransportError) as info:
            spbcast.broadcast(None, sp, leader, timeout=1)
        text = str(info.value)
        assert info.value.code == "timeout"
        assert text.startswith(f"spbcast: rank {rank}: broadcast #") and f"from root {leader} failed" in text, text
        if rank == 3:
            assert "rank 1" not in text and "root 0" not in text, text
        # The group is broken afterwards (as documented); its next error says so, in global ranks.
        with pytest.raises(spbcast.TransportError, match=f"^spbcast: rank {rank}: this group is out of step"):
            spbcast.broadcast(None, sp, leader, timeout=1)
    dist.barrier()


def test_errors_name_global_ranks():
    run(4, _ranks)
